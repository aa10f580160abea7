"""The check's report: each output's comparison, greedy generation, what the inputs covered, the
verdict."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

SWAPPED = (
    "the reference is itself a fold by enjoyln and the candidate holds none: the two look given "
    "in the wrong order (the original comes first: enjoyln check ORIGINAL FOLDED)"
)
"""Why a failed check of an unfolded candidate against a folded reference most likely failed."""


def worse(a: float, b: float) -> float:
    """``max`` that a NaN cannot lower (Python's ``max(0.0, nan)`` is 0.0)."""
    return math.inf if math.isnan(a) or math.isnan(b) else max(a, b)


@dataclass
class OutputCheck:
    """One named output, worst case over all batches."""

    name: str
    max_abs_diff: float  # infinite where a non-finite value differs
    max_rel_diff: float
    passed: bool
    reference_error: float | None = (
        None  # precision-aware: max|reference - truth|, its own rounding
    )
    candidate_error: float | None = None  # precision-aware: max|candidate - truth|
    allowed: float | None = None
    """The bound the judged quantity had to meet (candidate_error, or max_abs_diff with rtol)."""
    margin: float | None = (
        None  # allowed / the judged quantity (above 1 passes); None where they agree exactly
    )
    nonfinite: int = (
        0  # elements where the candidate is NaN or ±Inf and the reference is not (or another)
    )
    # how the candidate was loaded ("enjoyln.load", "from_pretrained"); empty for models in memory
    path: str = ""
    required: bool = True  # False where this path is reported but not part of the verdict
    tolerance: float | None = None
    """The largest max|candidate - reference| the criterion allows; bounds a greedy flip's
    near-tie."""
    scale: float = 0.0  # max|reference| over the finite elements (what max_rel_diff divides by)

    @property
    def label(self) -> str:
        return f"{self.name} ({self.path})" if self.path else self.name


@dataclass
class NearTie:
    """A greedy token that differs where the reference's top choices were within the tolerance."""

    row: int
    step: int
    reference_token: int
    candidate_token: int
    reference_margin: (
        float  # its score of its token minus the candidate's token's, in the scores generate() used
    )
    deviation: float  # max|candidate - reference| over the raw step logits up to this step
    candidate_margin: float = (
        0.0  # the candidate's score of its token minus the reference's token's
    )


@dataclass
class GenerationCheck:
    """Greedy decoding from the same prompts: identical tokens, but for a row that flips at a
    genuine near-tie (``generation.judge_generation``); the tokens after a flip are not
    compared."""

    passed: bool
    new_tokens: int
    reference: list[list[int]] = field(default_factory=list)
    candidate: list[list[int]] = field(default_factory=list)
    required: bool = True  # False in half precision, where a near-tie may flip a token legitimately
    prompt_tokens: int = 0
    identical: bool = True
    tolerance: float | None = None
    near_ties: list[NearTie] = field(default_factory=list)
    problem: str = ""


@dataclass
class Coverage:
    """What the forward comparison's inputs reached."""

    positions: int = 0  # positions 0 .. positions-1 of the longest sequence fed
    max_positions: int | None = (
        None  # what the config allows (None: not a sequence model, or no limit)
    )
    distinct_ids: int = 0
    vocab_size: int | None = None
    sweep_limit: int | None = None
    """The token sweep's limit (``--sweep-tokens``) where it stopped there, short of the whole
    vocabulary."""

    def describe(self) -> str:
        allowed = f" of {self.max_positions}" if self.max_positions else ""
        vocab = f" of {self.vocab_size}" if self.vocab_size else ""
        if self.sweep_limit is not None:
            vocab += (
                f" (the token sweep stopped at its limit of {self.sweep_limit:,} ids; "
                "--sweep-tokens)"
            )
        parts = [
            f"positions 0-{self.positions - 1}{allowed}" if self.positions else "",
            f"{self.distinct_ids} distinct token ids{vocab}" if self.distinct_ids else "",
        ]
        return ", ".join(p for p in parts if p)


@dataclass
class CheckReport:
    """The outcome of ``check``; ``passed`` is the verdict."""

    passed: bool
    max_abs_diff: float | None
    """Over the outputs compared; None where no output was (the forward comparison did not run)."""
    max_rel_diff: float | None
    outputs: list[OutputCheck]
    batches: int
    dtype: str
    criterion: str
    generation: GenerationCheck | None = None
    coverage: Coverage | None = None
    static: Any = None  # the ``StaticReport``, when the static check ran
    forward_skipped: str = ""  # why the forward comparison did not run, if it did not
    memory: str = ""  # how the models were held, when not both in memory (a check within a budget)
    criterion_kind: str = (
        ""  # "precision" (from the reference's own rounding) or "rtol" (a fixed one)
    )
    truth_dtype: str = ""
    margin: float | None = None  # the smallest margin of the outputs in the verdict
    paths: list[str] = field(default_factory=list)  # the candidate's load paths that ran
    caveat: str = ""  # what the verdict does not cover, shown with it
    notes: list[str] = field(default_factory=list)
    generation_settings: list[str] = field(
        default_factory=list
    )  # each fails: generate() applies them
    factor: float | None = None  # the precision-aware criterion's factor

    @classmethod
    def from_static(cls, static: Any, why: str) -> "CheckReport":
        return cls(
            passed=static.passed,
            max_abs_diff=None,
            max_rel_diff=None,
            outputs=[],
            batches=0,
            dtype="",
            criterion="",
            static=static,
            forward_skipped=why,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def verdict(self, subject: str = "the candidate") -> str:
        """The report in one plain sentence, PASS or FAIL first, naming what was proven or what
        differs.
        >>> CheckReport.from_static(type("S", (), {"passed": True, "byte_identical": True, "problems": [],
        ...     "scope": "static check"})(), "identical").verdict()
        'PASS: the candidate is byte for byte the original, so it computes the same outputs'
        """  # noqa: E501
        static = self.static
        caveat = f"; {self.caveat}" if self.caveat else ""
        if not self.passed:
            return f"FAIL: {self._what_differs(subject)}"
        if static is not None and getattr(static, "byte_identical", False):
            return f"PASS: {subject} is byte for byte the original, so it computes the same outputs"
        if self.forward_skipped:
            return (
                f"PASS: every weight of {subject} is what the fold makes of the original's, proven "
                "tensor by "
                f"tensor (no forward pass was run){caveat}"
            )
        within = (
            f"within {self.factor:g}\u00d7 the original's own rounding"
            if self.criterion_kind == "precision" and self.factor is not None
            else "within the fixed tolerance"
        )
        parts = (["every weight proven"] if static is not None else []) + [
            f"{self.batches} batch{'es' if self.batches != 1 else ''} {within}"
        ]
        if self.generation is not None and self.generation.passed:
            parts.append(
                "the same greedy tokens" + ("" if self.generation.identical else " up to near-ties")
            )
        parts += ["weights not compared"] if static is None else []
        return f"PASS: {subject} computes the same outputs ({'; '.join(parts)}){caveat}"

    def _what_differs(self, subject: str) -> str:
        static = self.static
        if getattr(static, "swapped", False):  # the likely cause first; the differences as given
            return f"{SWAPPED}; as given, {self._weights_differ(subject)}"
        return self._weights_differ(subject)

    def _weights_differ(self, subject: str) -> str:
        static = self.static
        if static is not None and not static.passed:
            problems = static.problems
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            first = problems[0] if problems else "see the report"
            if static.scope != "static check":
                return f"{subject} fails the check of its {static.scope}: {first}{more}"
            differing = getattr(static, "differing", 0)
            if getattr(static, "plan_problems", 0):  # the cause first: the tensors are its symptoms
                others = len(problems) - differing - 1
                return (
                    f"{subject} does not match the plan it records: {first}"
                    + (f" (and {others} more)" if others > 0 else "")
                    + (
                        f"; judged without that plan, {differing} of {static.tensors} tensors "
                        "differ"
                        if differing
                        else ""
                    )
                )
            if differing:  # where and by how much, before the other problems
                others = len(problems) - differing
                first = static.first_differing
                more = (
                    f" ({differing} of {static.tensors} tensors differ"
                    + (f"; and {others} other problem{'s' if others > 1 else ''}" if others else "")
                    + ")"
                )
            return (
                f"the weights of {subject} are not what the fold makes of the original's: "
                f"{first}{more}"
            )
        wrong = [o for o in self.outputs if o.required and not o.passed]
        if wrong:
            o = wrong[0]
            off = o.candidate_error if o.candidate_error is not None else o.max_abs_diff
            how = (
                f"has {o.nonfinite} NaN or Inf values where the original has none"
                if o.nonfinite
                else f"is off by {off:.3g} where {o.allowed:.3g} is allowed"
                if o.allowed is not None
                else "differs"
            )
            more = f" (and {len(wrong) - 1} more outputs)" if len(wrong) > 1 else ""
            return f"{subject} computes different outputs: {o.label} {how}{more}"
        if self.generation_settings:
            return f"{subject} generates differently: {self.generation_settings[0]}"
        g = self.generation
        if g is not None and not g.passed:
            return f"{subject} decodes other greedy tokens than the original" + (
                f": {g.problem}" if g.problem else ""
            )
        return f"{subject} does not compute the same outputs"

    def summary(self) -> str:
        lines = [("PASS" if self.passed else "FAIL") + (f" ({self.caveat})" if self.caveat else "")]
        if self.static is not None:
            lines += [f"  {line}" for line in self.static.summary().splitlines()]
        if self.forward_skipped:
            lines.append(f"  forward comparison not run: {self.forward_skipped}")
            return "\n".join(lines)
        covered = (
            f"; inputs cover {self.coverage.describe()}"
            if self.coverage and self.coverage.describe()
            else ""
        )
        paths = f" through {' and '.join(self.paths)}" if self.paths else ""
        lines += [
            f"  forward: {len(self.outputs)} outputs over {self.batches} batches "
            f"({self.dtype}){paths}; "
            f"max abs diff {self.max_abs_diff:.3g}, max rel diff {self.max_rel_diff:.3g}{covered}",
            f"  criterion: {self.criterion}"
            + (f"; margin {self.margin:.3g}x" if self.margin is not None else ""),
        ]
        lines += [f"  memory: {self.memory}"] if self.memory else []
        lines += [f"  note: {note}" for note in self.notes]
        for o in self.outputs:
            extra = (
                f"; vs {self.truth_dtype or 'truth'}: candidate {o.candidate_error:.3g}, "
                f"original {o.reference_error:.3g}"
                if o.candidate_error is not None
                else ""
            )
            extra += f", allowed {o.allowed:.3g}" if o.allowed is not None else ""
            extra += f" (margin {o.margin:.3g}x)" if o.margin is not None else ""
            extra += (
                f"; {o.nonfinite} elements NaN or Inf where the original is not (or another "
                "non-finite value)"
                if o.nonfinite
                else ""
            )
            state = (
                ("ok" if o.passed else "FAIL")
                if o.required
                else ("differs" if not o.passed else "ok") + ", not required"
            )
            lines.append(
                f"  [{state}] {o.label}: abs {o.max_abs_diff:.3g}, rel {o.max_rel_diff:.3g}{extra}"
            )
        lines += [f"  [FAIL] {problem}" for problem in self.generation_settings]
        g = self.generation
        if g is not None:
            state = (
                "identical" if g.identical else "same up to near-ties" if g.passed else "DIFFERENT"
            )
            note = "" if g.required else " (informational in half precision)"
            lines.append(
                f"  greedy generation of {g.new_tokens} tokens after {g.prompt_tokens}: "
                f"{state}{note}"
            )
            lines += [
                f"    row {t.row} step {t.step}: token {t.candidate_token} for "
                f"{t.reference_token}, "
                f"margins {t.reference_margin:.3g} (original) and {t.candidate_margin:.3g} "
                f"(candidate) in the scores generate() used, step logits within "
                f"{t.deviation:.3g} of the original's (tolerance {g.tolerance:.3g})"
                for t in g.near_ties
            ]
            lines += [f"    {g.problem}"] if g.problem else []
        return "\n".join(lines)
