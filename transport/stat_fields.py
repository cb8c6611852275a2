"""The statistics convention: a component's ``statistics()`` returns one frozen slotted dataclass.

Role
    Each component (the pool, the index, a tier, the peer links, the descriptor budget...) reports
    its state as a ``<Component>Stats`` dataclass, and each of its fields says, in its metadata,
    where it goes:

    - ``metric(name, help, ...)``: ``/metrics`` exports a family from it (or a sample of one that
      several fields share: ``hkvd_pool_bytes{state=...}`` takes four); ``metrics(...)`` for more
      than one family from one field; ``counter_series(...)`` for a ``hkvd.daemon.metrics`` counter; a
      ``"histogram"`` metric's sampler returns ``histogram_samples(...)`` (each sample names its suffix,
      ``_bucket``, ``_sum`` or ``_count``, under the reserved label ``SUFFIX``; ``sample_name`` reads it);
    - ``status_only()``: ``hkvd status`` shows it, ``/metrics`` does not;
    - ``part()``: a nested stats dataclass (or None), whose own fields say.

    ``status_dict(stats)`` is the status JSON (``hkvd status --json``, the control socket's
    ``StatusReply``): the dataclass as a dict, field names as keys in field order, tuples as lists,
    a ``part(flatten=True)`` merged into its parent, a ``part(omit_none=True)`` left out while None.
    ``families(stats)`` walks the same fields into ``Family`` records; ``hkvd.daemon.http`` hands
    them to prometheus-client. tests/unit/test_stat_fields.py fails for a field that declares
    nothing and for an exported name no field declares, so the two views cannot drift apart.

    Here, below every layer, because the status JSON crosses the control socket and the peer
    transport's statistics (``hkvd.transport.base``) are part of it.

Threading
    Pure functions over immutable values; nothing here imports prometheus-client.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, NamedTuple

META_KEY = "hkvd.stat"  # the key of a field's declaration in its dataclasses metadata

MetricType = Literal["gauge", "counter", "histogram"]
Labels = dict[str, str]
Sample = tuple[Labels, float]
# A field's value and the stats object that holds it -> the field's samples. The values are of every
# type a stats field has, hence Any (the samplers are small functions next to the fields they read).
Sampler = Callable[[Any, Any], Iterable[Sample]]
# A histogram's samples carry the suffix of their sample name (``_bucket``, ``_sum``, ``_count``) under this
# label, which the exporter removes (``sample_name``); Prometheus reserves label names that begin with "__".
SUFFIX = "__suffix__"


@dataclasses.dataclass(frozen=True, slots=True)
class StatusOnly:
    """Shown by ``hkvd status`` (and read by code and tests); no ``/metrics`` family."""


@dataclasses.dataclass(frozen=True, slots=True)
class Part:
    """A nested stats dataclass (or None: nothing to show). ``flatten``: its fields join the parent's in
    the status JSON; ``omit_none``: the key is left out while the value is None."""

    flatten: bool = False
    omit_none: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Metric:
    """One Prometheus family a field feeds.

    ``labels``: this field's constant labels (``{"state": "used"}``). A mapping-valued field gives one
    sample per key, the key as the value of label ``key``. ``samples`` overrides both: (value, owner)
    -> samples. ``optional``: no family at all while there are no samples (else HELP and TYPE with
    none). ``each``: the field maps names to values, one family per name, its samples ``each(value,
    owner)``; ``name`` and ``help`` are templates of ``{key}`` (the name) and ``{words}`` (it with spaces).
    Counters' samples carry ``_total`` (added by the exporter); a histogram's, the suffix under label
    ``SUFFIX`` (``histogram_samples``).
    """

    name: str
    help: str
    type: MetricType = "gauge"
    labels: tuple[tuple[str, str], ...] = ()
    key: str = ""
    samples: Sampler | None = None
    optional: bool = False
    each: Sampler | None = None

    def families(self, value: Any, owner: object) -> Iterator[Family]:
        if self.each is not None:
            for key, series in sorted(value.items()):
                fill = {"key": key, "words": key.replace("_", " ")}
                samples = list(self.each(series, owner))
                if samples or not self.optional:
                    yield Family(self.name.format(**fill), self.help.format(**fill), self.type, samples)
            return
        samples = list(self._samples(value, owner))
        if samples or not self.optional:
            yield Family(self.name, self.help, self.type, samples)

    def _samples(self, value: Any, owner: object) -> Iterable[Sample]:
        if self.samples is not None:
            return self.samples(value, owner)
        if value is None:
            return []
        labels = dict(self.labels)
        if isinstance(value, Mapping):
            return [({**labels, self.key: str(k)}, float(v)) for k, v in sorted(value.items())]
        return [(labels, float(value))]


class Family(NamedTuple):
    """One exported family: ``samples`` are (labels, value); a counter's sample names end in ``_total``, a
    histogram's in the suffix its ``SUFFIX`` label names (``sample_name``)."""

    name: str
    help: str
    type: MetricType
    samples: list[Sample]


def sample_name(fam: Family, labels: Labels) -> tuple[str, Labels]:
    """The exposition's name of one sample of ``fam``, and its labels without ``SUFFIX``."""
    if fam.type == "counter":
        return f"{fam.name}_total", labels
    if fam.type == "histogram":
        rest = dict(labels)
        return fam.name + rest.pop(SUFFIX), rest
    return fam.name, labels


# ---- declaring fields ----------------------------------------------------------------------------
# Each returns a dataclasses.field(); keyword arguments (default=, default_factory=) pass through.

def metric(name: str, help: str, type: MetricType = "gauge", *, labels: Mapping[str, str] | None = None,
           key: str = "", samples: Sampler | None = None, optional: bool = False, **kw: Any) -> Any:
    """A field ``/metrics`` exports as family ``name`` (see ``Metric``)."""
    return metrics(Metric(name, help, type, tuple((labels or {}).items()), key, samples, optional), **kw)


def metrics(*declared: Metric, **kw: Any) -> Any:
    """A field that feeds every family in ``declared``."""
    return dataclasses.field(metadata={META_KEY: declared}, **kw)


def status_only(**kw: Any) -> Any:
    """A field ``hkvd status`` shows and ``/metrics`` does not export."""
    return dataclasses.field(metadata={META_KEY: StatusOnly()}, **kw)


def part(*, flatten: bool = False, omit_none: bool = False, **kw: Any) -> Any:
    """A nested stats dataclass (or None); see ``Part``."""
    return dataclasses.field(metadata={META_KEY: Part(flatten, omit_none)}, **kw)


def counter_series(name: str, help: str, *, always: bool = True) -> Any:
    """A field holding one ``hkvd.daemon.metrics`` counter's series, exported as counter ``name``;
    ``always``: a 0 sample before its first ``inc`` (else no family until then)."""
    return metric(name, help, "counter", samples=series(always=always), optional=not always, default_factory=dict)


def declaration(f: dataclasses.Field[object]) -> tuple[Metric, ...] | StatusOnly | Part | None:
    """What field ``f`` declares; None: nothing (a test fails for that)."""
    decl = f.metadata.get(META_KEY)
    if isinstance(decl, (StatusOnly, Part)) or (isinstance(decl, tuple) and all(isinstance(m, Metric) for m in decl)):
        return decl
    return None


# ---- the two views -------------------------------------------------------------------------------

def status_dict(stats: object) -> dict[str, object]:
    """The status JSON of ``stats`` (see the module docstring); plain dicts, lists and scalars."""
    out: dict[str, object] = {}
    for f in dataclasses.fields(stats):  # type: ignore[arg-type]  # any stats dataclass instance
        value = getattr(stats, f.name)
        decl = declaration(f)
        if isinstance(decl, Part):
            if value is None and decl.omit_none:
                continue
            if decl.flatten:
                out.update(status_dict(value))
                continue
        out[f.name] = _plain(value)
    return out


def _plain(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return status_dict(value)
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items()}
    return value


def families(stats: object) -> list[Family]:
    """Every family ``stats`` and its parts export, in field order; fields that feed one family share it."""
    found: dict[str, Family] = {}
    for fam in _walk(stats):
        have = found.get(fam.name)
        if have is None:
            found[fam.name] = fam
        else:
            have.samples.extend(fam.samples)
    return list(found.values())


def _walk(stats: object) -> Iterator[Family]:
    for f in dataclasses.fields(stats):  # type: ignore[arg-type]  # any stats dataclass instance
        value = getattr(stats, f.name)
        decl = declaration(f)
        if isinstance(decl, Part):
            if value is not None:
                yield from _walk(value)
        elif isinstance(decl, tuple):
            for m in decl:
                yield from m.families(value, stats)


def declared_metrics(cls: type) -> Iterator[tuple[str, Metric]]:
    """(field name, Metric) for every metric ``cls``'s own fields declare (parts not followed)."""
    for f in dataclasses.fields(cls):
        decl = declaration(f)
        if isinstance(decl, tuple):
            for m in decl:
                yield f.name, m


def histogram_samples(labels: Mapping[str, str], bounds: Iterable[float], counts: Iterable[int], total: float,
                      count: int) -> list[Sample]:
    """A histogram's samples: one ``_bucket`` per upper bound ``le`` (cumulative ``counts``, one per bound),
    ``le="+Inf"`` (``count``), ``_sum`` (``total``) and ``_count``; each also labelled ``labels``."""
    out: list[Sample] = [({**labels, "le": _le(b), SUFFIX: "_bucket"}, float(n)) for b, n in zip(bounds, counts,
                                                                                               strict=True)]
    out.append(({**labels, "le": "+Inf", SUFFIX: "_bucket"}, float(count)))
    out.append(({**labels, SUFFIX: "_sum"}, float(total)))
    out.append(({**labels, SUFFIX: "_count"}, float(count)))
    return out


def _le(bound: float) -> str:
    """An upper bound as prometheus-client writes it (0.001, 5e-05, 10.0)."""
    return repr(float(bound))


def series(*, always: bool) -> Sampler:
    """Samples of a ``{((label, value), ...): number}`` mapping (a ``hkvd.daemon.metrics`` counter's
    series), label sets in order; ``always``: one unlabelled 0 sample while there is none."""
    def sampler(value: Mapping[tuple[tuple[str, str], ...], float], _owner: object) -> list[Sample]:
        got = [(dict(labels), float(v)) for labels, v in sorted(value.items())]
        return got or ([({}, 0.0)] if always else [])
    return sampler
