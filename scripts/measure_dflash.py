"""Measure a trained DFlash drafter folder on its recipe's target with DFlashGenerator (greedy; every output checked
against plain greedy decoding): `python scripts/measure_dflash.py RECIPE DRAFTER_DIR NUM_PROMPTS MAX_NEW_TOKENS`."""
import json
import sys

import torch

from eagle3_zoo.drafters.dflash.model import DFlashDrafter
from eagle3_zoo.recipe.sections import load_recipe
from eagle3_zoo.speculative.dflash_decode import DFlashGenerator, measure
from eagle3_zoo.targets.loading import load_recipe_target

recipe_path, folder, n, max_new = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
recipe = load_recipe(recipe_path)
target, tok, adapter = load_recipe_target(recipe.target, recipe.drafter, recipe.trainer, recipe_path, device="cpu")
drafter = DFlashDrafter.from_pretrained(folder).eval()
questions = ["What is the capital of France?", "Write a short poem about the sea.",
             "Explain what a neural network is in simple terms.", "Give me three tips for staying productive.",
             "How do I make a cup of tea?", "What are the benefits of regular exercise?",
             "Summarize the plot of Romeo and Juliet.", "Write a Python function that reverses a string."][:n]
prompts = [torch.tensor(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]) for q in questions]
torch.manual_seed(0)
print(json.dumps(measure(DFlashGenerator(target, drafter, adapter), prompts, max_new, warmup=0), indent=1,
                 default=str))
