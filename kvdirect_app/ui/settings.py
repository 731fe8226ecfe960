"""What the controls mean: the strategies on offer and the run they describe.

Strategy specs are built generically from the registry: a ticked strategy
gets the shared settings (`budget`, `spacing`, `mode`) that its dataclass
declares and its spec does not already set, so a strategy added as one new
file shows up here without an edit.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..models import DTYPES, ModelError, available_devices, presets
from ..strategies import StrategyError, parse_specs, registry

REFERENCE = "full"  # the engine's reference lane: every other lane is compared with it
DEFAULT_MODEL = "smollm2-135m"
# Display order and names of the strategies the papers discuss; anything else registered follows, by name.
TITLES = {
    "full": "Full KV cache",
    "kvdirect": "KV-Direct",
    "anchorkv": "AnchorKV",
    "h2o": "H2O",
    "streaming_llm": "StreamingLLM",
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "window": "Sliding window",
}
BASELINES = ("h2o", "streaming_llm", "snapkv", "tova", "window")
DEFAULT_PANES = ("full", "kvdirect", "anchorkv", "h2o", "streaming_llm", "snapkv", "tova")
SHARED = ("budget", "spacing", "mode", "rebuild")
EXTRA_PANES = 3  # panes beyond one per registered strategy, for extra specs


def catalogue() -> list[str]:
    """Registered strategy names, the papers' order first."""
    names = registry()
    return [n for n in TITLES if n in names] + sorted(n for n in names if n not in TITLES)


def title(label: str) -> str:
    name = label.split(":", 1)[0]
    return TITLES.get(name, name)


def blurb(name: str) -> str:
    """First line of the strategy's docstring."""
    doc = (getattr(registry().get(name), "__doc__", None) or "").strip()
    return doc.splitlines()[0] if doc else ""


def default_names() -> list[str]:
    """Full cache, KV-Direct, AnchorKV and the eviction baselines with a paper (the plain window is one tick away)."""
    return [n for n in catalogue() if n in DEFAULT_PANES]


def declares(name: str, setting: str) -> bool:
    cls = registry().get(name)
    return cls is not None and setting in cls.settings()


def any_declares(setting: str) -> bool:
    return any(declares(n, setting) for n in catalogue())


def max_panes() -> int:
    return len(catalogue()) + EXTRA_PANES


def expand(entry: str, budget: int | None = None, spacing: int | None = None, mode: str | None = None,
           rebuild: str | None = None) -> str:
    """`name[:k=v...]` plus each shared setting the strategy declares and the entry leaves unset."""
    entry = entry.strip()
    name, *pairs = entry.split(":")
    given = {p.partition("=")[0] for p in pairs}
    for key, value in zip(SHARED, (budget, spacing, mode, rebuild)):
        if value is not None and declares(name, key) and key not in given:
            pairs.append(f"{key}={value}")
    return ":".join([name, *pairs])


@dataclass(frozen=True)
class RunConfig:
    """Everything that fixes a run's tokens: equal configs replay to equal conversations (greedy)."""

    model: str
    device: str
    dtype: str
    specs: tuple[str, ...]
    max_new_tokens: int
    raw: bool = False
    twins: bool = True  # teacher-forced twins: agreement and KL measured after a divergence too


@dataclass(frozen=True)
class Settings:
    """The values of the controls, as the handlers receive them (one keyword per control)."""

    model: str
    custom_model: str
    device: str
    dtype: str
    strategies: tuple[str, ...]
    extra_specs: str
    budget: int
    spacing: int
    mode: str
    rebuild: str
    max_new_tokens: int
    twins: bool = True

    @classmethod
    def from_controls(cls, values: dict) -> "Settings":
        v = dict(values)
        v["strategies"] = tuple(v.get("strategies") or ())
        v["custom_model"] = (v.get("custom_model") or "").strip()
        v["extra_specs"] = (v.get("extra_specs") or "").strip()
        for key in ("budget", "spacing", "max_new_tokens"):
            v[key] = int(v[key])
        return cls(**v)

    @property
    def model_name(self) -> str:
        return self.custom_model or self.model

    def specs(self) -> list[str]:
        """Expanded specs of the ticked strategies and the extra specs, checked by the registry's parser."""
        entries = [n for n in catalogue() if n in self.strategies]
        entries += [e for e in self.extra_specs.split(",") if e.strip()]
        if not entries:
            raise StrategyError("no strategy selected; tick at least one")
        specs = [expand(e, self.budget, self.spacing, self.mode, self.rebuild) for e in entries]
        parse_specs(",".join(specs))  # one clear error for unknown names, settings or duplicates
        if len(specs) > max_panes():
            raise StrategyError(f"{len(specs)} strategies selected; this page shows at most {max_panes()}")
        return specs

    def run_config(self, raw: bool = False) -> RunConfig:
        if self.dtype not in DTYPES:
            raise ModelError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.device not in available_devices():
            raise ModelError(f"device {self.device!r} is not available here; choose one of {', '.join(available_devices())}")
        if not self.model_name:
            raise ModelError(f"no model given; choose a preset ({', '.join(presets())}) or type a Hub id or path")
        return RunConfig(self.model_name, self.device, self.dtype, tuple(self.specs()), self.max_new_tokens, raw,
                         bool(self.twins))
