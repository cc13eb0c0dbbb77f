"""Checkpoints, the final model and resume for one training run.

Which files a run leaves and when: ``checkpoint-N`` directories (mirrored to object storage when a mirror is
set), the final model assembled out of sight and moved into place with its completion marker last, the
upload of an s3:// output_dir, and the decision that a run is already complete or where it resumes from.
The main process writes; a user error there (a full disk) is raised on every rank, so none waits forever.

Under DeepSpeed every rank takes part in a checkpoint: the policy's full weights are gathered (ZeRO-3) for
the main process to write, and each rank writes its partition of the optimizer state through the engine into
the same temporary directory (:mod:`rloo.training.checkpoint`), which therefore has to be one that every rank
sees: one machine, or, on several nodes, an output directory on a filesystem they all share. A save checks
this and stops in one line otherwise (a checkpoint missing other nodes' partitions could never be resumed).
The mirror and an s3:// output_dir's upload stay the main process's: with the directory shared, it sees every
rank's files.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rloo.config import RLOOConfig, mirror_uri
from rloo.diskspace import disk_full_as_one_line, honour_umask, tensor_bytes, write_bytes_atomic
from rloo.errors import UserError
from rloo.models import MERGED_SUBDIR, describe_value, find_bad_tensor
from rloo.training import deepspeed_utils, lora, ref_sync, run_record
from rloo.training.checkpoint import (
    ENGINE_DIR,
    PREFIX,
    STATE,
    begin_checkpoint,
    checkpoint_problem,
    engine_world_size,
    engine_zero_stage,
    list_checkpoints,
    load_checkpoint,
    newest_intact_checkpoint,
    save_checkpoint,
    save_engine_state,
    temporary_dir,
)
from rloo.training.collectives import Collectives
from rloo.training.metrics import METRICS_FILE, PLOTS_DIR, SAMPLES_DIR, SAMPLES_FILE
from rloo.training.output_lock import LOCK_NAME

log = logging.getLogger(__name__)

COMPLETE_MARKER = "training_complete.json"
# where the final model is assembled inside output_dir before its files are moved into place
FINAL_TMP = ".final-model.tmp"
# Left out of the upload of an s3:// output_dir: checkpoints (mirrored to <prefix>/checkpoints as they are
# written), an embedded MLflow store (a live sqlite file; MLFLOW_TRACKING_URI names a server to use) and the
# staging directory's lock file.
PUBLISH_EXCLUDE = ("checkpoint-*", ".checkpoint-*", "mlruns", FINAL_TMP, LOCK_NAME)
# written by the main process into a checkpoint's temporary directory under DeepSpeed and read by every rank
SHARED_PROBE = ".shared-by-every-rank"


class CheckpointManager:
    """Saves and restores one run's policy, optimizer, scheduler and trainer state.

    ``trainer_state(update)`` gives the trainer's own position (episode, tokens, data order...) to store
    beside the weights; :meth:`resume` hands it back. ``reference``: the reference model of a run that moves
    it (--sync_ref_model), saved with every checkpoint and restored on resume; None (a frozen reference, the
    default) saves nothing of it. ``extra_state()``, called on every rank at each save, gives files the
    checkpoint holds besides (name -> a ``torch.save``-able value, written by the main process); after
    :meth:`resume`, ``resumed_from`` is the checkpoint it restored.
    """

    def __init__(
        self,
        *,
        accelerator: Any,
        cfg: Any,
        policy: Any,
        optimizer: Any,
        scheduler: Any,
        tokenizer: Any,
        num_updates: int,
        trainer_state: Callable[[int], dict[str, Any]],
        mirror: Any = None,
        remote: Any = None,
        deepspeed: bool = False,
        comm: Collectives | None = None,
        reference: Any = None,
        extra_state: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.accelerator = accelerator
        self.cfg = cfg
        self.policy = policy
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.num_updates = num_updates
        self.trainer_state = trainer_state
        self.mirror = mirror
        self.remote = remote
        self.deepspeed = deepspeed
        self.comm = comm or Collectives(accelerator)
        self.world = self.comm.world
        self.reference = reference
        self.extra_state = extra_state
        self.resumed_from: Path | None = None
        self._last_saved: tuple[int, Path] | None = None
        self._started_over = False  # --overwrite_output_dir removed the previous run: nothing to resume

    def check_weights(self, update: int, state_dict: dict[str, Any] | None = None) -> None:
        """Never write a model holding NaN/inf (or overflowing) weights: a reader would take it as trained."""
        bad = None
        if self.accelerator.is_main_process:  # under ZeRO-3 only it holds the assembled weights
            model = self.accelerator.unwrap_model(self.policy)
            bad = find_bad_tensor(state_dict.items() if state_dict is not None else model.named_parameters())
        bad = self.comm.broadcast(bad)
        if bad is not None:
            name, peak = bad
            raise UserError(
                f"update {update} of {self.num_updates}: the policy's tensor {name!r} holds "
                f"{describe_value(peak)} (phase save); training stopped, no model saved (checkpoints written "
                f"before it are intact): lower --learning_rate (got {self.cfg.learning_rate:g}) or check the "
                "model and the rewards."
            )

    def save(self, out_dir: Path, update: int) -> Path:
        """checkpoint-<update> in out_dir (written by the main process, mirrored when a mirror is set); call it
        on every rank. Under DeepSpeed every rank writes its share of the engine's state first."""
        path = out_dir / f"{PREFIX}{update}"
        # under ZeRO-3 the weights are sharded: every rank takes part in assembling them (the main process
        # gets them); elsewhere the main process's model holds them whole
        model_state = self._gathered_policy_state()
        self.check_weights(update, model_state)
        # under ZeRO-3 every rank helps assemble the reference's weights (the main process gets them)
        reference_state = (
            ref_sync.reference_state_dict(
                self.reference, accelerator=self.accelerator, deepspeed=self.deepspeed
            )
            if self.reference is not None
            else None
        )
        if self.deepspeed:
            self._save_engine(out_dir, update)
        extra = self.extra_state() if self.extra_state is not None else None  # every rank: may gather

        def write() -> None:
            save_checkpoint(
                out_dir,
                update,
                model=self.accelerator.unwrap_model(self.policy),
                tokenizer=self.tokenizer,
                # under DeepSpeed the optimizer's state is the engine's, written above by every rank
                optimizer=None if self.deepspeed else self.optimizer,
                scheduler=self.scheduler,
                state=self.trainer_state(update),
                config=self.cfg.to_dict(),
                total_limit=self.cfg.save_total_limit,
                # the metrics so far travel with the checkpoint, so a fresh machine resumes them too
                extra_files=[out_dir / METRICS_FILE],
                extra_objects=extra,
                reference_state=reference_state,
                model_state=model_state,
                begun=self.deepspeed,
            )
            if self.mirror is not None:
                self.mirror.submit(path)

        self.on_main(write)
        self.accelerator.wait_for_everyone()
        self._last_saved = (update, path)
        return path

    def save_to_resume(self, out_dir: Path, update: int, *, reuse: bool) -> Path:
        """checkpoint-<update> for a run that stops here (preempted, its rollout server lost): the periodic one
        of that update when ``reuse`` allows, else a new one; mirrored before it returns, since a fresh pod
        resumes from the mirror."""
        path = self.saved(update) if reuse else None
        path = path or self.save(out_dir, update)
        if self.mirror is not None:
            self.mirror.wait()
        return path

    def saved(self, update: int) -> Path | None:
        """The checkpoint this run saved last, when it was taken at ``update`` and is still there."""
        if self._last_saved is None or self._last_saved[0] != update or not self._last_saved[1].is_dir():
            return None
        return self._last_saved[1]

    def _gathered_policy_state(self) -> dict[str, Any] | None:
        """The policy's full state dict under ZeRO-3 (on the main process; {} elsewhere), None otherwise."""
        if not (self.deepspeed and deepspeed_utils.is_zero3(self.accelerator)):
            return None
        return dict(self.accelerator.get_state_dict(self.policy) or {})

    def _save_engine(self, out_dir: Path, update: int) -> None:
        """Every rank: the DeepSpeed engine's checkpoint into checkpoint-<update>'s temporary directory, which
        the main process starts afresh and every rank must see (a UserError on every rank otherwise)."""
        tmp = temporary_dir(out_dir, update)
        token = None
        if self.accelerator.is_main_process:
            begin_checkpoint(out_dir, update)
            token = uuid.uuid4().hex
            (tmp / SHARED_PROBE).write_text(token)
        token = self.comm.broadcast(token)  # after the main process wrote it
        try:
            seen = (tmp / SHARED_PROBE).read_text() == token
        except OSError:
            seen = False
        blind = self.comm.any(not seen, self.accelerator.device)
        if self.accelerator.is_main_process:
            (tmp / SHARED_PROBE).unlink()
            if blind:
                shutil.rmtree(tmp, ignore_errors=True)
        if blind:
            raise UserError(
                f"checkpoint {PREFIX}{update}: under DeepSpeed every process writes its part of the optimizer "
                f"state into {out_dir}, and some processes do not see what the main process writes there "
                "(a disk of each node's own?): give --output_dir (or --local_dir) a filesystem that every node "
                "shares, or run on one node."
            )
        # each rank's partition of the optimizer state, fp32 weights and moments: ~12 bytes per parameter
        needed = 12 * lora.parameter_counts(self.policy)[1] // self.world  # full sizes, not ZeRO-3 shards
        try:
            with disk_full_as_one_line(out_dir / f"{PREFIX}{update}", needed, f"checkpoint {PREFIX}{update}"):
                save_engine_state(tmp, self.policy)
        except BaseException:
            # a rank that fails here leaves the others waiting in DeepSpeed's barrier: it exits, and the
            # launcher stops them; what was written is removed where the main process can
            if self.accelerator.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def save_final(self, out_dir: Path) -> None:
        """The trained model + tokenizer (safetensors) in output_dir, and a marker that training is done."""
        # under ZeRO-3 the weights are sharded: every rank takes part in assembling them
        state_dict = self.accelerator.get_state_dict(self.policy) if self.deepspeed else None
        self.check_weights(self.num_updates, state_dict)
        self.on_main(lambda: self._write_final(out_dir, state_dict))
        self.accelerator.wait_for_everyone()

    def _write_final(self, out_dir: Path, state_dict: dict[str, Any] | None) -> None:
        # Assembled in a hidden directory and moved into place file by file (renames take no space): a full
        # disk leaves neither a config.json without weights nor a truncated model.safetensors behind.
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / FINAL_TMP
        shutil.rmtree(tmp, ignore_errors=True)
        model = self.accelerator.unwrap_model(self.policy)
        needed = tensor_bytes((state_dict or model.state_dict()).values()) + 2**20
        try:
            with disk_full_as_one_line(out_dir, needed, "the final model"):
                tmp.mkdir()
                model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp)
                if self.cfg.use_peft:
                    lora.record_base_model(
                        tmp, self.cfg.sft_model_path or self.cfg.recorded()["model_name_or_path"]
                    )
                    if self.cfg.merge_adapter:
                        lora.save_merged(model, self.tokenizer, tmp / MERGED_SUBDIR)
                (tmp / "rloo_config.json").write_text(json.dumps(self.cfg.recorded(), indent=2, default=str))
                honour_umask(tmp)  # safetensors writes its files 0600
                for f in sorted(tmp.iterdir()):
                    if f.is_dir() and (out_dir / f.name).is_dir():  # merged/ of an earlier save
                        shutil.rmtree(out_dir / f.name)
                    os.replace(f, out_dir / f.name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        state = {**self.trainer_state(self.num_updates), "complete": True}
        # the marker last, whole or not at all: it is what says the directory holds a finished model
        write_bytes_atomic(out_dir / COMPLETE_MARKER, json.dumps(state, indent=2).encode(), COMPLETE_MARKER)

    def on_main(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on the main process; a UserError there (a full disk) is raised on every rank, so none
        is left waiting at the next barrier."""
        message = None
        if self.accelerator.is_main_process:
            try:
                fn()
            except UserError as e:
                if self.world == 1:
                    raise
                message = str(e)
        message = self.comm.broadcast(message)
        if message is not None:
            raise UserError(message)

    def publish(self, out_dir: Path) -> None:
        """With an s3:// output_dir: upload the final model, metrics.jsonl, samples and plots (not the
        checkpoints, mirrored on their own, nor an embedded MLflow store) with the manifest written last."""
        if self.remote is not None and self.accelerator.is_main_process:
            from rloo.storage import upload_dir

            upload_dir(out_dir, self.remote, progress=False, exclude=PUBLISH_EXCLUDE)
            log.info("published %s", self.remote.uri)
        self.accelerator.wait_for_everyone()

    def _done(self, marker: bytes | None) -> bool:
        if marker is None:
            return False
        try:
            done = json.loads(marker)
        except ValueError:
            return False
        return bool(done.get("complete")) and done.get("num_updates") == self.num_updates

    def already_complete(self, out_dir: Path) -> bool:
        """True when this run is already done (then nothing is trained). Decided on the main process (it alone
        writes) and shared, so every rank takes the same branch.

        A finished run in out_dir is never trained over without being asked: other settings are refused in
        one line (--overwrite_output_dir starts again), a longer run extends it from its newest checkpoint, and
        a shorter one is refused."""
        verdict, refusal = (
            self._settle_finished(out_dir) if self.accelerator.is_main_process else (None, None)
        )
        verdict, refusal = self.comm.broadcast((verdict, refusal))
        if refusal is not None:
            raise UserError(refusal)
        if verdict == "start_over":
            self._start_over(out_dir)
            return False
        if verdict == "unpublished":  # trained here, but the upload did not finish: upload, don't train again
            self.publish(out_dir)
        if verdict is not None:
            where = self.remote.uri if self.remote is not None else out_dir
            log.info("%s already holds a completed run of %d updates: nothing to do", where, self.num_updates)
        return verdict is not None

    def _settle_finished(self, out_dir: Path) -> tuple[str | None, str | None]:
        """(verdict, refusal) on the main process: "done" or "unpublished" (nothing to train), "start_over"
        (--overwrite_output_dir over a finished run), None (train: resume decides from where), or a one-line
        refusal."""
        choice = self.cfg.resume_from_checkpoint
        finished = self._finished_run(out_dir)
        if finished is None:
            return (self._completion(out_dir) if choice == "latest" else None), None
        settings, trained = finished
        if getattr(self.cfg, "overwrite_output_dir", False):
            return "start_over", None
        where = self.remote.uri if self.remote is not None else out_dir
        if choice == "none":
            return None, (
                f"{where} holds a finished run, which --resume_from_checkpoint none would train again over its "
                f"model; {run_record.START_AGAIN}."
            )
        if choice != "latest":  # a checkpoint named: resume compares its settings
            return None, None
        changes = run_record.changed_settings(settings, self.cfg) if settings and self._compares() else []
        if changes:
            return None, (
                f"{where} holds a finished run trained with other settings ({run_record.describe(changes)}), "
                f"which cannot change within a run; {run_record.START_AGAIN}."
            )
        if trained == self.num_updates:
            return self._completion(out_dir), None
        lengths = (
            run_record.changed_settings(settings or {}, self.cfg, lengths=True) if self._compares() else []
        )
        asked = f"{self.num_updates} ({run_record.describe(lengths)})" if lengths else str(self.num_updates)
        if trained > self.num_updates:
            return None, (
                f"{where} holds a finished run of {trained} updates and this command asks for {asked}: a finished "
                f"run can be extended, not shortened; {run_record.START_AGAIN}."
            )
        if newest_intact_checkpoint(out_dir)[0] is None and (
            self.mirror is None or self.mirror.latest() is None
        ):
            return None, (
                f"{where} holds a finished run of {trained} updates and this command asks for {asked}, but the run "
                f"kept no checkpoint to continue from (one every --save_steps {self.cfg.save_steps} updates); "
                f"{run_record.START_AGAIN}."
            )
        log.info("extending the finished run of %d updates in %s to %s", trained, where, asked)
        return None, None

    def _compares(self) -> bool:
        # a whole config: tests build managers over a stand-in holding only what checkpoints read
        return isinstance(self.cfg, RLOOConfig)

    def _finished_run(self, out_dir: Path) -> tuple[dict[str, Any] | None, int] | None:
        """(settings, updates) of a finished run in out_dir (for an s3:// output_dir: at its prefix when the
        staging directory holds none), or None."""
        marker_path = out_dir / COMPLETE_MARKER
        marker = run_record.read_json(marker_path.read_bytes()) if marker_path.is_file() else None
        settings = run_record.recorded_settings(out_dir)
        if (marker is None or not marker.get("complete")) and self.remote is not None:
            from rloo.storage.backends import backend_for

            backend = backend_for(self.remote)
            marker = run_record.read_json(backend.read_bytes(COMPLETE_MARKER))
            settings = run_record.read_json(backend.read_bytes(run_record.CONFIG_FILE))
        if marker is None or not marker.get("complete") or not isinstance(marker.get("num_updates"), int):
            return None
        return settings, int(marker["num_updates"])

    def _start_over(self, out_dir: Path) -> None:
        """--overwrite_output_dir: the previous run's checkpoints, completion marker, sample tables and plots go
        (its model files are replaced when this run finishes; metrics.jsonl when its first update is logged)."""
        if self.accelerator.is_main_process:
            for _, path in list_checkpoints(out_dir):
                shutil.rmtree(path)
            for name in (COMPLETE_MARKER, SAMPLES_FILE):
                (out_dir / name).unlink(missing_ok=True)
            for name in (SAMPLES_DIR, PLOTS_DIR):
                shutil.rmtree(out_dir / name, ignore_errors=True)
            log.warning(
                "--overwrite_output_dir: starting again in %s; the previous run's checkpoints are removed",
                out_dir,
            )
        self.accelerator.wait_for_everyone()
        self._started_over = True

    def _completion(self, out_dir: Path) -> str | None:
        """ "done", "unpublished" (s3:// output_dir: complete in the staging directory only) or None."""
        marker = out_dir / COMPLETE_MARKER
        local_done = self._done(marker.read_bytes() if marker.is_file() else None)
        if self.remote is None:
            return "done" if local_done else None
        # s3://: the prefix decides (a complete upload whose marker matches), never the staging directory
        from rloo.storage import IncompleteArtifactError, verify_prefix
        from rloo.storage.backends import backend_for

        try:
            verify_prefix(self.remote)
            if self._done(backend_for(self.remote).read_bytes(COMPLETE_MARKER)):
                return "done"
        except IncompleteArtifactError:
            pass
        return "unpublished" if local_done else None

    def resume(self, out_dir: Path) -> dict[str, Any] | None:
        """Restore the newest (or the given) checkpoint into the model, optimizer and scheduler; return the
        trainer state saved with it, or None for a fresh run."""
        choice = self.cfg.resume_from_checkpoint
        if choice == "none" or self._started_over:
            return None
        if choice == "latest":
            try:
                path = self.latest_intact(out_dir)
            except UserError:
                if not getattr(self.cfg, "overwrite_output_dir", False):
                    raise
                self._start_over(out_dir)
                return None
            if path is None:
                return None
        else:
            path = Path(choice)
            problem = checkpoint_problem(path) if path.is_dir() else "no such directory"
            if problem:
                raise UserError(
                    f"--resume_from_checkpoint {choice}: {problem}; pass a complete checkpoint-N directory, "
                    "'latest' or 'none'."
                )
        reference_file = path / ref_sync.REFERENCE_FILE
        if self.reference is not None and not reference_file.is_file():
            raise UserError(
                f"cannot resume from {path}: it was written without --sync_ref_model (it holds no reference "
                "model); start a new --output_dir, or resume without --sync_ref_model."
            )
        if self.reference is None and reference_file.is_file():
            log.warning(
                "%s was written with --sync_ref_model: this run keeps the original reference model", path
            )
        self._check_layout(path)
        verdict = self._resumable(path) if self.accelerator.is_main_process else None
        verdict = self.comm.broadcast(verdict)
        if verdict == "start_over":
            self._start_over(out_dir)
            return None
        if verdict is not None:
            raise UserError(verdict)
        try:
            st = load_checkpoint(
                path,
                model=self.accelerator.unwrap_model(self.policy),
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                # under DeepSpeed the engine loads the weights and its optimizer state, on every rank
                engine=self.policy if self.deepspeed else None,
            )
            if self.reference is not None:
                ref_sync.load_reference(
                    self.reference, reference_file, accelerator=self.accelerator, deepspeed=self.deepspeed
                )
        # DeepSpeed's own loader fails with assertions and key errors too
        except (ValueError, RuntimeError, KeyError, AssertionError) as e:
            raise UserError(
                f"cannot resume from {path}: {(str(e).splitlines() or [type(e).__name__])[0]}; pass "
                "--resume_from_checkpoint none to start over."
            ) from None
        if st.get("num_updates") != self.num_updates:
            log.warning(
                "%s was written by a run of %s updates; this one has %d (its length settings or its number of "
                "processes changed): the learning-rate schedule now spans %d updates",
                path,
                st.get("num_updates"),
                self.num_updates,
                self.num_updates,
            )
        log.info("resumed from %s (update %d of %d)", path, st["update"], self.num_updates)
        self.resumed_from = path
        return st

    def _resumable(self, path: Path) -> str | None:
        """None when this command may resume ``path``; "start_over" (--overwrite_output_dir) or a one-line
        refusal when the checkpoint was written with other settings, or holds more updates than asked for."""
        if not self._compares():
            return None
        settings = run_record.recorded_settings(path) or {}
        changes = run_record.changed_settings(settings, self.cfg)
        state = run_record.read_json((path / STATE).read_bytes()) or {}
        trained = int(state.get("update", 0))
        if not changes and trained <= self.num_updates:
            return None
        if getattr(self.cfg, "overwrite_output_dir", False):
            return "start_over"
        if changes:
            return (
                f"cannot resume {path} with other settings ({run_record.describe(changes)}), which cannot change "
                f"within a run; {run_record.START_AGAIN}."
            )
        lengths = run_record.changed_settings(settings, self.cfg, lengths=True)
        return (
            f"cannot resume {path}: it has trained {trained} updates and this command asks for {self.num_updates}"
            f"{f' ({run_record.describe(lengths)})' if lengths else ''}; ask for at least {trained}, or "
            f"{run_record.START_AGAIN}."
        )

    def _check_layout(self, path: Path) -> None:
        """A one-line UserError for a checkpoint this run cannot read: one written with DeepSpeed (its optimizer
        state split between the ranks) resumed without, or the other way round, or one whose ZeRO partitions
        are for another number of processes (DeepSpeed does not split them anew)."""
        written_with = (path / ENGINE_DIR).is_dir()
        if written_with and not self.deepspeed:
            raise UserError(
                f"cannot resume from {path}: it was written under DeepSpeed (its optimizer state is in "
                f"{ENGINE_DIR}/, split between the processes), which a run without DeepSpeed cannot read; resume "
                "it with the same DeepSpeed config, or pass --resume_from_checkpoint none to start over."
            )
        if self.deepspeed and not written_with:
            raise UserError(
                f"cannot resume from {path}: it was written without DeepSpeed (its optimizer state is in "
                "optimizer.pt), which a run under DeepSpeed cannot read; resume it without DeepSpeed, or pass "
                "--resume_from_checkpoint none to start over."
            )
        saved_stage = engine_zero_stage(path) if self.deepspeed else None
        stage = deepspeed_utils.zero_stage(self.accelerator)
        if saved_stage is not None and (saved_stage == 3) != (stage == 3):
            raise UserError(
                f"cannot resume from {path}: it was written under ZeRO-{saved_stage}, and this run uses "
                f"ZeRO-{stage}, whose checkpoint holds the weights another way; resume with the config it was "
                "written with, or pass --resume_from_checkpoint none to start over."
            )
        saved_world = engine_world_size(path) if self.deepspeed else None
        if saved_world is not None and saved_world != self.world:
            raise UserError(
                f"cannot resume from {path}: it was written by a DeepSpeed run of {saved_world} processes, whose "
                f"ZeRO optimizer state is split {saved_world} ways, and DeepSpeed cannot split it anew for "
                f"{self.world}; resume on {saved_world} processes, or pass --resume_from_checkpoint none to start "
                "over."
            )

    def latest_intact(self, out_dir: Path) -> Path | None:
        """The newest checkpoint in out_dir that matches its manifest, else the mirror's newest (fetched), else
        None. A damaged checkpoint is never a reason to start over: with an earlier intact one that one is used
        (one warning line saying so); with none, a UserError names the damaged file."""
        path, damaged = newest_intact_checkpoint(out_dir)
        if path is None and mirror_uri(self.cfg):
            self._restore_from_mirror(out_dir)
            path, damaged = newest_intact_checkpoint(out_dir)
        if not damaged:
            return path
        newest, problem = damaged[0]
        if path is None:
            raise UserError(
                f"cannot resume from {newest}: {problem}, and no earlier checkpoint is intact; put the file back "
                "as it was written, or pass --resume_from_checkpoint none to start over."
            )
        log.warning(
            "%s is damaged (%s): resuming from %s, the newest intact checkpoint", newest, problem, path
        )
        return path

    def _restore_from_mirror(self, out_dir: Path) -> None:
        """A fresh machine: fetch the newest complete mirrored checkpoint (and its metrics) into out_dir."""
        restored = None
        if self.accelerator.is_main_process and self.mirror is not None:
            restored = self.mirror.restore_latest(out_dir)
            if restored is not None:
                log.info("restored %s from %s", restored.name, mirror_uri(self.cfg))
                snapshot = restored / METRICS_FILE
                if snapshot.is_file() and not (out_dir / METRICS_FILE).is_file():
                    shutil.copy2(snapshot, out_dir / METRICS_FILE)
        self.accelerator.wait_for_everyone()
