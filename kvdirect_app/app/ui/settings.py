"""What the controls mean: the strategies on offer and the run they describe.

Strategy specs are built generically from the registry: a ticked strategy
gets the shared settings (`budget`, `spacing`, `mode`) that its dataclass
declares and its spec does not already set, so a strategy added as one new
file shows up here without an edit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...plain.catalog import embedded_presets, hub_copy, is_test_model, offered_presets, presets, unavailable_reason
from ...plain.limits import SettingError, integer, limits
from ...plain.specs import STRATEGY_DIR, external, name_of, page_folder, settings_of
from .. import service

REFERENCE = "full"  # the engine's reference lane: every other lane is compared with it
PREFERRED_MODELS = ("smollm2-135m", "gemma3-270m")  # the first that loads here is the default (`default_model`)
COMPLETION = "completion model: continues your text, does not chat"
MODES, REBUILDS = ("exact", "fast"), ("step", "turn")
KERNELS = ("invariant", "native")  # kernels.MODES (this module imports no torch)
# Display order and names of the strategies the papers discuss; anything else registered follows, by name.
TITLES = {
    "full": "Full KV cache",
    "kvdirect": "KV-Direct",
    "anchorkv": "AnchorKV",
    "h2o": "H2O",
    "streaming_llm": "StreamingLLM",
    "snapkv": "SnapKV",
    "tova": "TOVA",
    "knorm": "KNorm",
    "pyramidkv": "PyramidKV",
    "window": "Sliding window",
}
BASELINES = ("h2o", "streaming_llm", "snapkv", "tova", "knorm", "pyramidkv", "window")
DEFAULT_PANES = ("full", "kvdirect", "anchorkv", "h2o", "streaming_llm", "snapkv", "tova")
SHARED = ("budget", "spacing", "mode", "rebuild")
EXTRA_PANES = 3  # panes beyond one per registered strategy, for extra specs


def default_model() -> str:
    """The first of PREFERRED_MODELS that loads here: SmolLM2 (a chat model) from its package (`make demo`) or,
    where that is absent (a Space installs requirements.txt only), its Hub copy where the Hub or the local Hub
    cache has it (`catalog.hub_copy`); else Gemma 3-270M (a base model, `model_note`); else the first preset on
    this machine."""
    return next((m for m in PREFERRED_MODELS if unavailable_reason(m) is None), embedded_presets()[0])


def model_note(name: str) -> str:
    """What a preset's model does with a message, where it is not a chat model (its preset's `chat = false`: the
    engine feeds the text as it is, with no chat template); "" otherwise."""
    p = presets().get(name)
    return "" if p is None or p["kind"] == "tiny" or p.get("chat") else COMPLETION


def model_choices() -> list[tuple[str, str]]:
    """(label, name) for the model dropdown: real models first, the random-weight test models last, labelled; a
    Hub copy says where it comes from, a base model that it does not chat."""
    names, table = offered_presets(), presets()
    where = {n: hub_copy(table[n]) for n in names}
    real = [
        (" · ".join(filter(None, (n, model_note(n), where[n] and f"from {where[n]}"))), n)
        for n in names
        if not is_test_model(n)
    ]
    return real + [(f"{n} · test model, random weights", n) for n in names if is_test_model(n)]


def missing_models_note() -> str:
    """Which presets' packages are not here (SmolLM2 on a Space: its package cannot come from requirements.txt)
    and what that means: it loads its Hub copy from where it was found; not found, hosted mode does not offer it,
    and elsewhere choosing it tries the Hub again."""
    lines = []
    for name, p in presets().items():
        reason, where = unavailable_reason(name), hub_copy(p)
        if where:
            lines.append(f"{name}: {p['package']} is not installed; it loads its Hub copy {p['hub_id']} from {where}.")
        elif reason:
            lines.append(
                f"{name} is not offered here: {reason}."
                if name not in offered_presets()
                else f"{name}: {reason}; choosing it tries the Hub again."
            )
    return " ".join(lines)


def catalogue() -> list[str]:
    """Registered strategy names, the papers' order first."""
    names = service.strategy_catalogue()
    return [n for n in TITLES if n in names] + sorted(n for n in names if n not in TITLES)


def title(label: str) -> str:
    name = name_of(label)
    return TITLES.get(name, name)


def default_names() -> list[str]:
    """Full cache, KV-Direct, AnchorKV and the eviction baselines with a paper (the plain window is one tick away)."""
    return [n for n in catalogue() if n in DEFAULT_PANES]


def declares(name: str, setting: str) -> bool:
    if external(name):
        return setting in service.strategy_settings(name)
    return setting in service.strategy_catalogue().get(name, {}).get("settings", {})


def any_declares(setting: str) -> bool:
    return any(declares(n, setting) for n in catalogue())


def max_panes() -> int:
    return len(catalogue()) + EXTRA_PANES


def expand(
    entry: str,
    budget: int | None = None,
    spacing: int | None = None,
    mode: str | None = None,
    rebuild: str | None = None,
) -> str:
    """`name[:k=v...]` plus each shared setting the strategy declares and the entry leaves unset."""
    entry = entry.strip()
    found = external(entry)  # a file's or module's class: "PATH.py:Class" is its name
    name, pairs = (":".join(found) if found else entry.split(":")[0]), settings_of(entry)
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
    kernels: str = "invariant"  # batch-invariant GEMMs and block attention, or the model's own kernels


def panes_only(old: RunConfig | None, new: RunConfig) -> bool:
    """`new` differs from `old` in its panes alone (added, removed, reordered): the conversation keeps its engine,
    the panes that leave are dropped and the new ones replay the earlier turns alone (`runner.play(rearrange=)`)."""
    return old is not None and old.specs != new.specs and dataclasses.replace(old, specs=new.specs) == new


def changed(old: RunConfig, new: RunConfig) -> list[str]:
    """The settings that differ between two runs, by name (the panes as "strategies")."""
    names = {"specs": "strategies", "max_new_tokens": "max new tokens"}
    return [names.get(f, f) for f in RunConfig.__dataclass_fields__ if getattr(old, f) != getattr(new, f)]


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
    kernels: str = "invariant"

    @classmethod
    def from_controls(cls, values: dict) -> "Settings":
        """The controls' values, each checked (an API caller can send anything): one message per bad setting."""
        v = {f: values.get(f) for f in cls.__dataclass_fields__}
        strategies = v["strategies"] or ()
        if isinstance(strategies, str) or not all(isinstance(n, str) for n in strategies):
            raise SettingError(f"strategies: expected a list of names; allowed: {', '.join(catalogue())}")
        unknown = [n for n in strategies if n not in catalogue()]
        if unknown:
            raise SettingError(
                f"strategies: unknown {', '.join(map(repr, unknown))}; allowed: {', '.join(catalogue())}"
            )
        v["strategies"] = tuple(strategies)
        for key in ("model", "custom_model", "extra_specs"):
            if v[key] is not None and not isinstance(v[key], str):
                raise SettingError(f"{key}: expected text")
            v[key] = (v[key] or "").strip()
        cap = limits()
        v["budget"] = integer("budget", v["budget"], 1, 1 << 20)
        v["spacing"] = integer("spacing", v["spacing"], 1, 4096)
        v["max_new_tokens"] = integer("max_new_tokens", v["max_new_tokens"], 1, cap.max_new_tokens)
        for key, allowed in (("mode", MODES), ("rebuild", REBUILDS)):
            if v[key] not in allowed:
                raise SettingError(f"{key}: {str(v[key])[:40]!r} is not allowed; allowed: {', '.join(allowed)}")
        v["kernels"] = "invariant" if v["kernels"] is None else v["kernels"]
        if v["kernels"] not in KERNELS:
            raise SettingError(f"kernels: {str(v['kernels'])[:40]!r} is not allowed; allowed: {', '.join(KERNELS)}")
        v["twins"] = True if v["twins"] is None else v["twins"]
        if not isinstance(v["twins"], bool):
            raise SettingError("twins: expected true or false")
        if len(v["extra_specs"]) > 2_000:
            raise SettingError(
                f"The extra specs box holds {len(v['extra_specs']):,} characters; allowed: at most 2,000"
            )
        return cls(**v)

    @property
    def model_name(self) -> str:
        return self.custom_model or self.model

    def specs(self) -> list[str]:
        """Expanded specs of the ticked strategies and the extra specs, checked by the registry's parser."""
        entries = [n for n in catalogue() if n in self.strategies]
        extras = [e for e in self.extra_specs.split(",") if e.strip()]
        for entry in extras:  # before anything reads the spec: the box is web input, whoever fills it
            if external(entry) and page_folder() is None:
                raise SettingError(
                    f"extra specs: {entry.strip()[:80]!r} names a file or module, and this page runs "
                    "none (code is never taken from a web request); allowed: registered strategies, "
                    f"or .py files from the folder the operator names with {STRATEGY_DIR}=FOLDER on "
                    "a server bound to loopback"
                )
        entries += extras
        if not entries:
            raise SettingError("strategies: no strategy selected; tick at least one")
        specs = [expand(e, self.budget, self.spacing, self.mode, self.rebuild) for e in entries]
        service.check_specs(specs)  # one clear error for unknown names, settings or duplicates
        if len(specs) > max_panes():
            raise SettingError(f"strategies: {len(specs)} selected; this page shows at most {max_panes()}")
        return specs

    def run_config(self, raw: bool = False) -> RunConfig:
        name = service.check_model_name(self.model_name)
        device, dtype = service.check_device_dtype(self.device, self.dtype)
        return RunConfig(
            name, device, dtype, tuple(self.specs()), self.max_new_tokens, raw, bool(self.twins), self.kernels
        )
