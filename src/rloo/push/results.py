"""What a push did, as typed results: ``push_result.json`` is :meth:`PushResult.to_dict` (the same document,
key for key, whichever targets were configured)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rloo.push.gate import Decision
from rloo.push.registry import RegistryResult


@dataclass(frozen=True)
class StoredCopy:
    """A copy under ``storage_uri`` or ``production_uri``: ``uploaded`` is False when an identical complete
    copy was already there; a demotion says where the restored copy came from, or that the demoted model's
    copy was withdrawn (deleted) because no earlier champion could be put back."""

    uri: str
    uploaded: bool
    restored_from: str | None = None
    withdrawn: bool = False

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"uri": self.uri, "uploaded": self.uploaded}
        if self.restored_from is not None:
            d["restored_from"] = self.restored_from
        if self.withdrawn:
            d["withdrawn"] = True
        return d


@dataclass
class MlflowRecord:
    """The push run, and the registered version when the push registers one."""

    run_id: str
    registered: RegistryResult | None = None
    aliases: list[str] = field(default_factory=list)
    champion_version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"run_id": self.run_id}
        if self.registered is not None:
            reg = self.registered
            d.update(
                registered_model_name=reg.name,
                version=reg.version,
                source=reg.source,
                reused=reg.reused,
                model_id=reg.model_id,
            )
            d.update(aliases=self.aliases, champion_version=self.champion_version)
        return d


@dataclass
class PushResult:
    """What a push did, target by target (None: not configured, or not for this decision)."""

    decision: Decision
    promotion_margin: float
    run_key: str
    digests: dict[str, str]
    storage: StoredCopy | None = None
    production: StoredCopy | None = None
    mlflow: MlflowRecord | None = None
    hub: dict[str, str | None] | None = None

    @property
    def published(self) -> bool:
        """Whether the model went anywhere: a stored or production copy, a registered version or the Hub (a
        push with no destination still decides, and says that it published nothing)."""
        registered = self.mlflow is not None and self.mlflow.registered is not None
        return any(t is not None for t in (self.storage, self.production, self.hub)) or registered

    def to_dict(self) -> dict[str, Any]:
        """The ``push_result.json`` document. ``promoted``: the gate's verdict was champion *and* the model was
        published somewhere (a champion copied nowhere is promoted nowhere)."""
        return {
            "decision": self.decision.decision,
            "promoted": self.decision.promoted and self.published,
            "published": self.published,
            "reason": self.decision.reason,
            "against_champion": self.decision.against_champion_dict(),
            "promotion_margin": self.promotion_margin,
            "run_key": self.run_key,
            "digests": self.digests,
            "storage": None if self.storage is None else self.storage.to_dict(),
            "production": None if self.production is None else self.production.to_dict(),
            "mlflow": None if self.mlflow is None else self.mlflow.to_dict(),
            "hub": self.hub,
        }
