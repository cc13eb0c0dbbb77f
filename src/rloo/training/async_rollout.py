"""Generation that runs ahead of training (``--async_generation``): the batch of update ``u + s`` is generated
from the weights of update ``u`` while update ``u`` trains (``s`` = ``--max_staleness``), as verl's one-step-off
and TRL's asynchronous GRPO do.

Order of one update ``u``, all on the training thread but the generation itself:

1. take batch ``u`` (generated during update ``u - s``; at the start of a run, or where a checkpoint did not
   hold it, generated now from today's weights);
2. score it and take its log-probs: the "old" ones from a forward of today's weights, since the generator's
   are those of older weights (each row keeps its ``policy_version``; ``--vllm_importance_sampling_correction``
   weighs the loss by today's over the generator's probabilities);
3. bring the generator's weights to today's (``Generator.sync_weights``, before the optimization changes them),
   draw the prompts of batch ``u + s`` and start generating it on a worker thread;
4. the optimization of update ``u``; then wait for the worker.

The worker touches nothing but the generator (no collective, no sampler): a failure there is agreed on by every
process after the wait (``agree_on_failure``), and the prompts it had drawn are put back. Every batch's seeds
are those of the update it is for, so a run with asynchronous generation is reproducible, and a checkpoint holds
the batches generated ahead (``rollouts_ahead.pt``, gathered from every rank): a resumed run trains on exactly
the batches the uninterrupted one would have, on any number of processes.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rloo.errors import UserError
from rloo.generation import Generated
from rloo.training.experience import ExperienceProducer, Rollout
from rloo.training.vllm_server import agree_on_failure

log = logging.getLogger(__name__)

# in a checkpoint: every rank's batches generated ahead of the position it was taken at
AHEAD_FILE = "rollouts_ahead.pt"


class RolloutsAhead:
    """The batches generated ahead of the update that trains on them, and the one being generated."""

    def __init__(self, producer: ExperienceProducer, *, staleness: int, num_updates: int) -> None:
        self.producer, self.generator = producer, producer.generator
        self.staleness, self.num_updates = staleness, num_updates
        # the producer's collectives, process group, group size and pad id: the batches are its
        self.comm, self.accelerator = producer.comm, producer.accelerator
        self.rloo_k, self.pad_token_id = producer.cfg.rloo_k, producer.tokenizer.pad_token_id
        self.ready: dict[int, Rollout] = {}  # update -> its batch
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rloo-rollout")
        # (update, prompts, weights' version, the sampler's state before the draw, the worker's future)
        self._in_flight: (
            tuple[int, list[int], int, dict[str, Any], Future[tuple[Generated, float]]] | None
        ) = None

    @classmethod
    def for_run(cls, cfg: Any, producer: ExperienceProducer, num_updates: int) -> RolloutsAhead | None:
        """The run's batches ahead with --async_generation (of ``cfg``, an ``RLOOConfig``), else None."""
        if not cfg.async_generation:
            return None
        steps = cfg.num_ppo_epochs * cfg.num_mini_batches
        if producer.accelerator is None or producer.accelerator.is_main_process:
            log.info(
                "async generation: the batch of update u+%d is generated from update u's weights while update u "
                "trains (its rows %d optimizer step%s old when trained: async/staleness)",
                cfg.max_staleness,
                cfg.max_staleness * steps,
                "" if cfg.max_staleness * steps == 1 else "s",
            )
        return cls(producer, staleness=cfg.max_staleness, num_updates=num_updates)

    # -- the loop -----------------------------------------------------------------------------------------
    def fill(self, position: int) -> None:
        """Batches ``position`` .. ``position + staleness - 1`` that are not there (the start of a run, a
        checkpoint without them), generated now from today's weights."""
        for update in range(position, min(position + self.staleness, self.num_updates)):
            if update not in self.ready:
                self.launch(update)
                self.wait()

    def take(self, update: int) -> Rollout:
        return self.ready[update]

    def consumed(self, update: int) -> None:
        """Batch ``update`` is in the weights now: a checkpoint no longer holds it."""
        self.ready.pop(update, None)

    def launch(self, update: int) -> None:
        """Start generating batch ``update`` (none past the run's end) from today's weights."""
        if update >= self.num_updates:
            return
        assert self._in_flight is None, "one batch in flight at a time"
        self._on_worker(True)
        try:
            self.generator.sync_weights()  # read now: the optimization changes them next
        except BaseException:
            self._on_worker(False)
            raise
        version = self.generator.weights_version or 0
        before = self.producer.sampler.state_dict()
        index = self.producer.draw()
        future = self._pool.submit(self._generate, update, index)
        self._in_flight = (update, index, version, before, future)

    def _generate(self, update: int, index: list[int]) -> tuple[Generated, float]:
        t0 = time.perf_counter()
        gen = self.producer.generate(update, index)
        return gen, time.perf_counter() - t0

    def wait(self) -> float:
        """Wait for the batch in flight; the seconds waited. A lost or refusing generator is raised on every
        process together (its prompts put back for the checkpoint)."""
        if self._in_flight is None:
            return 0.0
        update, index, version, before, future = self._in_flight
        self._in_flight = None
        t0 = time.perf_counter()
        failure: UserError | None = None
        try:
            gen, seconds = future.result()
        except UserError as e:  # lost (75) or refused (2)
            failure = e
        finally:
            self._on_worker(False)
        waited = time.perf_counter() - t0
        try:
            agree_on_failure(self.accelerator, failure, "rollout generation")
        except UserError:
            self.producer.sampler.load_state_dict(before)  # the resumed run draws these prompts again
            raise
        self.ready[update] = Rollout(update, index, gen, version, seconds)
        return waited

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _on_worker(self, on: bool) -> None:
        # the server's generator agrees on failures inside generate and pushes in sync_weights: from launch to
        # wait it copies the weights in sync_weights, sends them from the worker, and raises locally
        if hasattr(self.generator, "on_worker"):
            self.generator.on_worker = on

    # -- checkpoints --------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """Every rank's ready batches (on every rank: a gather), for the main process to write."""
        mine = {
            u: {
                "index": r.index,
                "tokens": r.generated.tokens.cpu(),
                "logprobs": None if r.generated.logprobs is None else r.generated.logprobs.cpu(),
                "version": r.version,
                "seconds": r.seconds,  # its generation's time, logged when it is trained on
            }
            for u, r in self.ready.items()
        }
        return {"parts": self.comm.gather_objects(mine)}

    def load(self, checkpoint: Path | None) -> None:
        """This rank's share of the batches a checkpoint holds (re-sliced when the number of processes
        changed: every row is its own seed's)."""
        path = None if checkpoint is None else checkpoint / AHEAD_FILE
        if path is None or not path.is_file():
            return
        parts = torch.load(path, weights_only=True)["parts"]
        for update in sorted(set.intersection(*(set(p) for p in parts))):
            rollout = self._share(update, [p[update] for p in parts])
            if rollout is None:
                log.warning(
                    "the batch of update %d generated ahead does not split over %d processes: generated again",
                    update + 1,
                    self.comm.world,
                )
                continue
            self.ready[update] = rollout

    def _share(self, update: int, parts: list[dict[str, Any]]) -> Rollout | None:
        k, world, rank = self.rloo_k, self.comm.world, self.comm.rank
        index = [i for p in parts for i in p["index"]]
        rows = [row for p in parts for row in p["tokens"]]  # each (T of its rank,)
        logprobs = (
            None if any(p["logprobs"] is None for p in parts) else [r for p in parts for r in p["logprobs"]]
        )
        if len(index) % world:
            return None
        ppr = len(index) // world
        lo, hi = rank * ppr * k, (rank + 1) * ppr * k
        width = max(rows[b].numel() for b in range(lo, hi))

        def padded(seq: list[torch.Tensor], fill: float) -> torch.Tensor:
            return torch.stack(
                [
                    torch.nn.functional.pad(seq[b], (0, width - seq[b].numel()), value=fill)
                    for b in range(lo, hi)
                ]
            )  # (B, width)

        gen = Generated(
            tokens=padded(rows, self.pad_token_id),
            logprobs=None if logprobs is None else padded(logprobs, 0.0),
        )
        version = min(int(p["version"]) for p in parts)
        seconds = max(float(p.get("seconds", 0.0)) for p in parts)
        return Rollout(update, index[rank * ppr : (rank + 1) * ppr], gen, version, seconds)
