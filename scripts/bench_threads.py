"""How the CPU thread setting decides speed on a quiet and on a loaded machine.

Each setting runs in a fresh interpreter (OpenMP reads its environment when torch loads), interleaved, first on the
machine as it is ("quiet") and then with a busy-loop process this script starts on one core for the duration of the
measurement ("loaded": what another job on a 2-core machine does). Workloads, on a random-weight model of the
embedded target's shape (SmolLM2-135M: 30 layers, hidden 576, fp32; no download):

  * decode: greedy KV-cache decoding of `--new-tokens` tokens after a 64-token prompt (what `eval` and
    regeneration at batch 1 spend their time in: hundreds of small parallel regions per token);
  * batch: one forward and backward over 4 x 128 tokens (what training and the feature job do: large matmuls).

Settings: `default` (nothing set: torch's one thread per core, libgomp's spinning waits), `omp1`
(`OMP_NUM_THREADS=1`), `passive2` (2 threads, `OMP_WAIT_POLICY=PASSIVE`: waiting threads sleep at once), `spin2` (2
threads, `GOMP_SPINCOUNT=10000`: they spin briefly, then sleep), and `auto` (what every eagle3-zoo command does:
`eagle3_zoo.util.threads.configure_threads`).

    .venv/bin/python scripts/bench_threads.py [--rounds 1] [--new-tokens 48] [--settings default,omp1,auto]

Prints its setup, `/proc/loadavg` before and after each load phase, and per setting and load the median time of
each workload and its ratio to `default` on the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    "default": {},
    "omp1": {"OMP_NUM_THREADS": "1"},
    "passive2": {"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "PASSIVE"},
    "spin2": {"OMP_NUM_THREADS": "2", "GOMP_SPINCOUNT": "10000"},  # spin briefly (libgomp's default: 300000)
    "auto": None,  # eagle3_zoo.util.threads.configure_threads() in the child, before torch is imported
}
_CLEARED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME",
            "EAGLE3_ZOO_THREADS")
ROOT = Path(__file__).resolve().parent.parent


def _loadavg() -> str:
    try:
        return Path("/proc/loadavg").read_text().strip()
    except OSError:
        return "n/a"


def child(setting: str, new_tokens: int) -> None:
    """Run the workloads in this process and print one JSON line."""
    chosen = None
    if SETTINGS[setting] is None:
        sys.path.insert(0, str(ROOT))
        from eagle3_zoo.util.threads import configure_threads

        chosen = configure_threads().describe()
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = json.loads((ROOT / "eagle3_zoo/resources/targets/HuggingFaceTB--SmolLM2-135M-Instruct.json").read_text())
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k not in ("architectures", "torch_dtype")}
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).float().eval()
    prompt = torch.randint(100, 40000, (1, 64))

    def decode(n: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            model.generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        return time.perf_counter() - start

    def batch() -> float:
        ids = torch.randint(100, 40000, (4, 128))
        start = time.perf_counter()
        model(ids, labels=ids).loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    decode(4)  # warm-up
    decode_s = sorted(decode(new_tokens) for _ in range(3))[1]
    batch()
    batch_s = sorted(batch() for _ in range(3))[1]
    print(json.dumps({"setting": setting, "threads": torch.get_num_threads(), "chosen": chosen,
                      "decode_ms_per_token": 1000 * decode_s / new_tokens, "batch_s": batch_s}))


def _run_child(setting: str, new_tokens: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(SETTINGS[setting] or {})
    out = subprocess.run([sys.executable, __file__, "--child", setting, "--new-tokens", str(new_tokens)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _busy_loop(seconds: float) -> subprocess.Popen:
    """One process spinning on one core, ending by itself after `seconds` (in case this script is killed)."""
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", code])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=1, help="interleaved rounds per load (default: 1)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--busy-seconds", type=float, default=1800, help="upper bound on the busy loop's life")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.new_tokens)
    settings = args.settings.split(",")
    import torch

    backend = torch.__config__.parallel_info().splitlines()[-1].strip()
    print(f"setup: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, affinity "
          f"{len(os.sched_getaffinity(0))}, torch {torch.__version__} ({backend}), Python "
          f"{platform.python_version()}; random-weight SmolLM2-135M shape fp32; decode {args.new_tokens} tokens after "
          f"64, batch = fwd+bwd 4 x 128; median of 3 each; {args.rounds} round(s)")
    results: dict[tuple[str, str], list[dict]] = {}
    for load in ("quiet", "loaded"):
        busy = _busy_loop(args.busy_seconds) if load == "loaded" else None
        try:
            time.sleep(1.0 if busy else 0)
            print(f"{load}: /proc/loadavg before {_loadavg()}", flush=True)
            for _ in range(args.rounds):
                for setting in settings:
                    r = _run_child(setting, args.new_tokens)
                    results.setdefault((load, setting), []).append(r)
                    print(f"  {load:6} {setting:8} threads={r['threads']} decode {r['decode_ms_per_token']:.1f} "
                          f"ms/token, batch {r['batch_s']:.2f} s{'  (' + r['chosen'] + ')' if r['chosen'] else ''}",
                          flush=True)
            print(f"{load}: /proc/loadavg after {_loadavg()}", flush=True)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    print("\n| load | setting | threads | decode ms/token | x default | batch s | x default |")
    print("|---|---|---|---|---|---|---|")
    for load in ("quiet", "loaded"):
        base = results.get((load, "default"))
        for setting in settings:
            rs = results[(load, setting)]
            dec = sorted(r["decode_ms_per_token"] for r in rs)[len(rs) // 2]
            bat = sorted(r["batch_s"] for r in rs)[len(rs) // 2]
            bd = sorted(r["decode_ms_per_token"] for r in base)[len(base) // 2] if base else None
            bb = sorted(r["batch_s"] for r in base)[len(base) // 2] if base else None
            print(f"| {load} | {setting} | {rs[0]['threads']} | {dec:.1f} | {dec / bd:.2f}x | {bat:.2f} | "
                  f"{bat / bb:.2f}x |" if base else f"| {load} | {setting} | {rs[0]['threads']} | {dec:.1f} | - | "
                  f"{bat:.2f} | - |")


if __name__ == "__main__":
    main()
