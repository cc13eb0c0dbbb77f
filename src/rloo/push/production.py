"""Copies in object storage and promotion (steps 2 and 5 of a push): the versioned copy under
``storage_uri``; the champion a challenger must beat; the production copy at ``production_uri``, published
atomically with its ledger (``promotion.json``: the champion's run key, its versioned copy and the champions
before it), and the ``champion`` alias; and a demotion, which puts the previous champion back or withdraws
the production copy."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from rloo.errors import UserError
from rloo.push.config import PushConfig
from rloo.push.gate import CANDIDATE, CHAMPION, Champion, Decision, parse_eval_results
from rloo.push.mlflow_run import PushRun
from rloo.push.registry import TAG_SOURCE_RUN, Registry, link_or_copy
from rloo.push.results import StoredCopy
from rloo.push.staging import StagedPush
from rloo.storage import (
    Location,
    delete_prefix,
    download_dir,
    is_complete,
    publish_atomic,
    read_manifest,
    upload_dir,
)
from rloo.storage.errors import IncompleteArtifactError
from rloo.storage.manifest import MANIFEST_NAME, build_manifest
from rloo.storage.transfer import read_published_file

log = logging.getLogger("rloo.push")

# In the production copy: which run's model it is, where its versioned copy is, and the champions before it.
LEDGER_FILE = "promotion.json"


def publish_copy(src: Path, uri: str, *, atomic: bool = False) -> bool:
    """Upload ``src`` to ``uri`` unless an identical complete copy is there. True if it uploaded.

    ``atomic`` (production): readers keep the complete previous version until the new one is complete, see
    :func:`rloo.storage.publish_atomic`; a push killed mid-copy leaves the old champion readable."""
    local = build_manifest(src)
    try:
        if is_complete(uri) and read_manifest(uri).by_path == local.by_path:
            return False
    except UserError:
        pass  # a missing bucket etc.: upload_dir says it properly
    if atomic:
        publish_atomic(src, uri, progress=False)
    else:
        upload_dir(src, uri, progress=False)
    return True


def current_champion(cfg: PushConfig, key: str, run: PushRun | None, out: Path) -> Champion | None:
    """The champion a challenger must beat: the registry's ``champion`` version, else (no registry) the run
    in ``production_uri``'s ledger; None when there is none, or when it is this run's own model (a re-run)."""
    if run is not None and run.registry.name:
        holder = run.registry.alias_holder(CHAMPION)
        source = (holder.tags or {}).get(TAG_SOURCE_RUN) if holder is not None else None
        if holder is None or source == key:
            return None
        label = f"version {holder.version} of run {source or holder.run_id}"
        data, why = run.registry.eval_results_of(holder, out / "champion")
        return _champion(label, data, why)
    if not cfg.production_uri:
        return None
    where = Location.parse(cfg.production_uri).uri
    try:
        ledger = read_ledger(cfg.production_uri)
        if ledger is None or ledger.get("run_key") == key:
            return None
        label = f"run {ledger.get('run_key')} at {where}"
        raw = read_published_file(cfg.production_uri, "eval_results.json")
    except IncompleteArtifactError as e:
        return Champion(f"the model at {where}", None, str(e), damaged=True)
    if raw is None:
        return Champion(label, None, "its copy has no eval_results.json")
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return Champion(label, None, "its eval_results.json is not valid JSON")
    return _champion(label, data, "")


def _champion(label: str, data: Any, why: str) -> Champion:
    if data is None:
        return Champion(label, None, why)
    try:
        return Champion(label, parse_eval_results(data, "its eval_results.json"))
    except UserError as e:
        return Champion(label, None, str(e))


def read_ledger(production_uri: str) -> dict[str, Any] | None:
    """``promotion.json`` of the production copy: ``{"run_key", "storage_uri", "previous": [...]}``; None when
    there is none. IncompleteArtifactError when it does not match the copy's manifest."""
    raw = read_published_file(production_uri, LEDGER_FILE)
    if raw is None:
        return None
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        log.warning(
            "%s/%s is not valid JSON: the production copy's run is unknown", production_uri, LEDGER_FILE
        )
        return None
    return data if isinstance(data, dict) else None


def promote(
    cfg: PushConfig,
    prepared: StagedPush,
    decision: Decision,
    registry: Registry | None,
    version: str | None,
    storage: str | None,
) -> StoredCopy | None:
    """Step 5: a champion goes to ``production_uri`` (atomically, with the ledger) and takes the alias; a
    candidate re-run of the model holding 'champion' gives it back (:func:`_demote`). Returns the production
    copy."""
    key = prepared.key
    if decision.promoted:
        production = None
        if cfg.production_uri:
            uri = Location.parse(cfg.production_uri).uri
            production = StoredCopy(uri, _publish_production(cfg, prepared.staged, key, storage))
        if registry is not None and version is not None:
            registry.take_champion(version, decision)
            # a re-run with a new decision (e.g. a lower margin) must not leave the version both
            registry.drop_alias_if_on(CANDIDATE, version)
        return production
    if registry is not None and version is not None:
        if CHAMPION in registry.aliases_of(version):
            return _demote(cfg, registry, version, Path(cfg.output_dir))
        return None
    if cfg.production_uri:  # no registry: the ledger says whose model production holds
        ledger = _ledger_or_empty(cfg.production_uri)
        if ledger.get("run_key") == key:
            return _demote_without_registry(cfg, ledger, Path(cfg.output_dir))
    return None


def _ledger_or_empty(production_uri: str) -> dict[str, Any]:
    """:func:`read_ledger` for the steps that go on without it: a damaged ledger is logged and read as none
    (the champion comparison, which must not, reads it itself)."""
    try:
        return read_ledger(production_uri) or {}
    except IncompleteArtifactError as e:
        log.warning(
            "the production copy's ledger is unreadable, its run and earlier champions unknown: %s", e
        )
        return {}


def _publish_production(cfg: PushConfig, staged: Path, key: str, storage: str | None) -> bool:
    """The staged files plus the ledger, atomically to ``production_uri``; True if it uploaded."""
    assert cfg.production_uri
    ledger = _ledger_or_empty(cfg.production_uri)
    previous = list(ledger.get("previous") or [])
    if ledger.get("run_key") and ledger.get("run_key") != key:
        previous.append({"run_key": ledger["run_key"], "storage_uri": ledger.get("storage_uri")})
    previous = [p for p in previous if isinstance(p, dict) and p.get("run_key") != key][-20:]
    return _publish_with_ledger(
        staged, cfg.production_uri, {"run_key": key, "storage_uri": storage, "previous": previous}
    )


def _publish_with_ledger(src: Path, uri: str, ledger: dict[str, Any]) -> bool:
    """``src``'s files (hard links) and ``ledger`` as ``promotion.json``, atomically to ``uri``."""
    dest = src.parent / "production"
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.name not in (LEDGER_FILE, MANIFEST_NAME):
            link_or_copy(f, dest / f.name)
    (dest / LEDGER_FILE).write_text(json.dumps(ledger, indent=1, sort_keys=True) + "\n")
    try:
        return publish_copy(dest, uri, atomic=True)
    finally:
        shutil.rmtree(dest, ignore_errors=True)


def _demote(cfg: PushConfig, registry: Registry, version: str, out: Path) -> StoredCopy | None:
    """Move 'champion' off ``version`` (back to the previous champion, or nowhere) and put the previous
    champion's published copy back at ``production_uri``, or withdraw the production copy when none can be."""
    previous = registry.previous_champion(version)
    registry.give_up_champion(version, previous)
    if previous is None:
        log.warning("'champion' removed from version %s: no earlier champion to restore", version)
    else:
        log.info("'champion' moved back from version %s to version %s", version, previous.version)
    if not cfg.production_uri:
        return None
    source_key = (previous.tags or {}).get(TAG_SOURCE_RUN) if previous is not None else None
    return _restore_production(cfg, source_key, out)


def _demote_without_registry(cfg: PushConfig, ledger: dict[str, Any], out: Path) -> StoredCopy:
    """No registry: the ledger in ``production_uri`` names the champions before this one; the newest whose
    versioned copy is still complete goes back, else the production copy is withdrawn."""
    previous = [p for p in ledger.get("previous") or [] if isinstance(p, dict) and p.get("run_key")]
    while previous:
        last = previous.pop()
        src = last.get("storage_uri")
        if src and is_complete(src):
            return _put_back(cfg, last["run_key"], src, previous, out)
    return _withdraw(cfg)


def _restore_production(cfg: PushConfig, source_key: str | None, out: Path) -> StoredCopy:
    """The registry's previous champion (its run key) back at ``production_uri`` from its versioned copy
    under ``storage_uri``, else the production copy is withdrawn."""
    assert cfg.production_uri
    if source_key and cfg.storage_uri:
        src = Location.parse(cfg.storage_uri).child(source_key).uri
        if is_complete(src):
            ledger = _ledger_or_empty(cfg.production_uri)
            previous = [
                p
                for p in ledger.get("previous") or []
                if isinstance(p, dict) and p.get("run_key") != source_key
            ]
            return _put_back(cfg, source_key, src, previous, out)
    return _withdraw(cfg)


def _put_back(cfg: PushConfig, key: str, src: str, previous: list[Any], out: Path) -> StoredCopy:
    """Publish the versioned copy ``src`` of run ``key`` to ``production_uri`` again, ``previous`` the
    champions before it in its ledger."""
    assert cfg.production_uri
    local = out / "previous_champion"
    download_dir(src, local, progress=False, overwrite=True)
    entry = {"run_key": key, "storage_uri": src, "previous": previous}
    uploaded = _publish_with_ledger(local, cfg.production_uri, entry)
    log.info("production copy restored to the previous champion, run %s", key)
    return StoredCopy(Location.parse(cfg.production_uri).uri, uploaded, restored_from=src)


def _withdraw(cfg: PushConfig) -> StoredCopy:
    """No approved model to put at ``production_uri``: delete the copy there (its manifest first, so readers
    stop accepting it at once) rather than leave a model the gate no longer approves."""
    assert cfg.production_uri
    prod = Location.parse(cfg.production_uri).uri
    delete_prefix(prod)
    log.warning("%s withdrawn: no earlier champion's copy to put back", prod)
    return StoredCopy(prod, uploaded=False, withdrawn=True)
