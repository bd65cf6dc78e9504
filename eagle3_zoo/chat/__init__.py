"""The chat layer, below the target adapters: the one conversation type (`conversation`: `Message`, the role
spellings and reasoning keys), the chat formats shipped in `resources/chat_formats/` with the one prompt renderer and
the loss-mask mapping (`formats`), and the tiny test tokenizers a chat format declares (`tiny_tokenizer`).
"""
