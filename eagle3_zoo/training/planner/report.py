"""The report of `eagle3-zoo plan`: lines of memory per GPU, grouped by phase, each phase with its verdict.

Lines held for a whole phase add up; lines of a sub-phase (the training step's buffers and the tau evaluation's
transient; regeneration's prefill and decode) only count for the sub-phase that needs more: the peak is the
persistent part plus the larger sub-phase.
"""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1024**3
RESERVE_FIXED_GIB = 1.0  # CUDA context, NCCL buffers
RESERVE_FRACTION = 0.10  # allocator fragmentation
TAU = "tau evaluation"


@dataclass
class PlanLine:
    what: str
    bytes: float
    note: str = ""
    phase: str = ""  # "" = held throughout; else the sub-phase that holds it (only the largest one counts)


def peak(lines: list[PlanLine]) -> tuple[float, str | None]:
    """Bytes of the persistent lines plus the largest sub-phase, and that sub-phase (None without any)."""
    phases: dict[str, float] = {}
    for line in lines:
        if line.phase:
            phases[line.phase] = phases.get(line.phase, 0.0) + line.bytes
    held = sum(line.bytes for line in lines if not line.phase)
    if not phases:
        return held, None
    top = max(phases, key=phases.__getitem__)
    return held + phases[top], top


def reserve_line(lines: list[PlanLine]) -> PlanLine:
    """The CUDA context and the allocator's fragmentation on top of `lines`' peak."""
    return PlanLine("reserve", RESERVE_FIXED_GIB * GIB + RESERVE_FRACTION * peak(lines)[0],
                    f"{RESERVE_FIXED_GIB:g} GiB CUDA context + {RESERVE_FRACTION:.0%} fragmentation")


@dataclass
class PhasePlan:
    """A phase before training planned on its own: where it runs, its lines (none: nothing to plan here, `where`
    says why) and the memory per GPU it must fit in."""

    name: str
    where: str
    lines: list[PlanLine] = field(default_factory=list)
    capacity_gb: float | None = None
    capacity_key: str = "trainer.gpu_memory_gb"
    after: list[str] = field(default_factory=list)  # printed after the verdict (hints, budgets)
    unit: str = "GPU"  # what one of its processes runs on ("CPU process" for a trainer-side phase of a CPU run)

    @property
    def total(self) -> float:
        return peak(self.lines)[0]

    @property
    def fits(self) -> bool | None:
        """None: nothing planned here, or no capacity declared."""
        if not self.lines or self.capacity_gb is None:
            return None
        return self.total <= self.capacity_gb * 1e9

    def table(self) -> list[str]:
        if not self.lines:
            return [f"{self.name}: {self.where}"]
        return [f"{self.name}: {self.where}; per {self.unit}:", *rows(self.lines),
                verdict(self.total, self.capacity_gb, self.name, self.capacity_key), *self.after]


@dataclass
class MemoryPlan:
    """Per-GPU memory of every phase of a recipe's run: the phases before training (`phases`: regeneration, hidden
    states) and the training phase (`lines`: the training step and the tau evaluation)."""

    source: str
    target: str
    strategy: str
    world_size: int
    gpu_memory_gb: float | None
    lines: list[PlanLine] = field(default_factory=list)
    phases: list[PhasePlan] = field(default_factory=list)
    decisions: str = ""  # the run plan (`eagle3_zoo.recipe.decisions`) in words
    devices_counted: str = ""  # how trainer.devices "auto" / -1 was counted (empty: a count was given)
    tau_off: str = ""  # why the tau evaluation does not run (empty: it runs)
    unit: str = "GPU"  # what one trainer rank runs on (`run_plan.trainer_device`)

    @property
    def total(self) -> float:
        """The training phase's peak: the persistent lines plus its larger sub-phase."""
        return peak(self.lines)[0]

    @property
    def peak_phase(self) -> str | None:
        """The sub-phase that sets the training peak (None without sub-phases)."""
        return peak(self.lines)[1]

    @property
    def fits(self) -> bool | None:
        return None if self.gpu_memory_gb is None else self.total <= self.gpu_memory_gb * 1e9

    def phase(self, name: str) -> PhasePlan | None:
        return next((p for p in self.phases if p.name == name), None)

    @property
    def feature_job(self) -> list[PlanLine]:
        """The lines of an in-process feature job (offline, backend hf); empty otherwise."""
        hs = self.phase("hidden states")
        return hs.lines if hs is not None and hs.where.startswith("feature job") else []

    @property
    def feature_job_fits(self) -> bool | None:
        return self.phase("hidden states").fits if self.feature_job else None

    def not_fitting(self) -> list[str]:
        """The phases that do not fit, in run order (empty: everything that was planned fits)."""
        return [p.name for p in self.phases if p.fits is False] + (["training"] if self.fits is False else [])

    def table(self) -> str:
        """The plan as text: the decisions, then each phase with its lines and verdict, then the overall verdict."""
        counted = f" ({self.devices_counted})" if self.devices_counted else ""
        out = [f"{self.source}: target {self.target}, strategy {self.strategy}, {self.world_size} device(s){counted}; "
               "per device (GB = 1e9 bytes):", f"  {self.decisions}"]
        for p in self.phases:
            out += ["", *p.table()]
        out += ["", f"training (training step and tau evaluation); per trainer {self.unit}:", *rows(self.lines),
                verdict(self.total, self.gpu_memory_gb, "training")]
        if self.tau_off:
            out.append(f"{TAU}: {self.tau_off}")
        else:
            held = sum(x.bytes for x in self.lines if not x.phase)
            tau = held + sum(x.bytes for x in self.lines if x.phase == TAU)
            out.append(verdict(tau, self.gpu_memory_gb, TAU) + " (the lines held throughout + its buffers)")
        bad = self.not_fitting()
        open_ = [p.name for p in self.phases if p.lines and p.fits is None] + ([] if self.fits is not None else
                                                                               ["training"])
        out.append("")
        if bad:
            out.append(f"plan: does NOT fit: {', '.join(bad)}")
        elif open_:
            out.append(f"plan: no verdict for {', '.join(open_)} (no GPU memory declared)")
        else:
            out.append("plan: every phase planned here fits")
        return "\n".join(out)


def rows(lines: list[PlanLine]) -> list[str]:
    """One row per line, each sub-phase's lines under a header row with the sub-phase's sum, then the peak."""
    total, top = peak(lines)
    phases = {line.phase for line in lines if line.phase}
    width = max(len(line.what) + (2 if line.phase else 0) for line in lines)
    width = max([width, *(len(p) + 1 for p in phases)])

    def row(what: str, size: float, note: str = "") -> str:
        return f"  {what.ljust(width)}  {size / 1e9:9.2f} GB  {note}".rstrip()

    out, seen = [], set()
    for line in lines:
        if line.phase and line.phase not in seen:
            seen.add(line.phase)
            size = sum(x.bytes for x in lines if x.phase == line.phase)
            note = ("sets the peak" if line.phase == top else "smaller, not counted") if len(phases) > 1 else ""
            out.append(row(f"{line.phase}:", size, note))
        out.append(row(f"  {line.what}" if line.phase else line.what, line.bytes, line.note))
    out.append(row("total", total, f"peak: the lines held throughout + the {top}" if len(phases) > 1 else ""))
    return out


def verdict(total: float, capacity_gb: float | None, what: str, key: str = "trainer.gpu_memory_gb") -> str:
    if capacity_gb is None:
        return f"{what}: no {key} declared, so no verdict ({total / 1e9:.1f} GB needed)"
    word = "fits" if total <= capacity_gb * 1e9 else "does NOT fit"
    return f"{what}: {word}: {total / 1e9:.1f} GB of {capacity_gb:g} GB per GPU ({key})"
