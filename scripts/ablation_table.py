"""Markdown table of an ablation directory written by scripts/ablate_smollm2.sh.

    python scripts/ablation_table.py runs/ablate eagle3 ttt1 last_layer no_regen

Per variant it reads `<dir>/<variant>/drafter/provenance.json` (training steps, validation accuracy),
`<dir>/<variant>.fit_seconds` (wall time of `eagle3-zoo fit`, data preparation included) and
`<dir>/<variant>/eval_{tree,chain}.json` (`eagle3-zoo eval` results). A missing file is shown as "-".
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LABELS = {
    "eagle3": "EAGLE-3 as specified (3 layers, TTT 7, regenerated data)",
    "ttt1": "TTT depth 1",
    "last_layer": "last-layer-only features (HF index 29)",
    "no_regen": "no regeneration (original ShareGPT answers)",
}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def row(root: Path, variant: str) -> str:
    run = root / variant
    prov = _load(run / "drafter" / "provenance.json") or {}
    training = prov.get("training", {})
    metrics = training.get("final_metrics", {})
    seconds = (root / f"{variant}.fit_seconds").read_text().strip() if (root / f"{variant}.fit_seconds").is_file() \
        else None
    cells = [LABELS.get(variant, variant), str(training.get("global_step", "-")), seconds or "-",
             _fmt(metrics.get("val/acc_0"), ".3f")]
    for mode in ("tree", "chain"):
        res = _load(run / f"eval_{mode}.json")
        overall = (res or {}).get("overall", {})
        cells.append(_fmt(overall.get("tau")))
        if mode == "chain":
            acc = overall.get("acceptance_per_depth") or []
            cells.append(" / ".join(_fmt(a) for a in acc[:3]) if acc else "-")
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = Path(argv[0])
    print("| Variant | Steps | `fit` wall time, data preparation included (s) | val acc_0 | tau tree 8/10/60 "
          "| tau chain 7 | chain accept d1/d2/d3 |")
    print("|---|---|---|---|---|---|---|")
    for variant in argv[1:]:
        print(row(root, variant))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
