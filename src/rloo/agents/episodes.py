"""Multi-turn episodes: the model's turns, the tools it calls, their results, until it answers.

An episode is one row of the batch: the prompt, then every token after it, the model's own (sampled) and the
tools' results (appended), in the order they happened. :class:`EpisodeRunner` drives any
:class:`rloo.generation.Generator` (the built-in one, a colocated vLLM engine, a vLLM server):

1. the first turn samples K completions of each prompt, as a single-turn rollout does;
2. a turn that ended with the stop token and holds tool calls has them run (all episodes' calls at once, under
   one timeout), and the tool messages' tokens are appended: the tokens the chat template renders after an
   assistant turn for those messages, found as TRL does (``_get_tool_suffix_ids``: a dummy conversation
   rendered with and without them), so the context of the next turn is the exact token sequence sampled
   so far plus the tool messages, never a re-rendering of earlier turns;
3. the episodes that called tools sample their next turn (one completion each), and so on, until every episode
   answered without a call, ran out of ``max_tool_calling_iterations``, or out of its token budget
   (``response_length`` tokens after the prompt, tools' included; a tool message that would not fit ends the
   episode where it is, as in TRL).

What comes back is a :class:`rloo.generation.Generated` (the episode's tokens, the sampler's log-probs at the
model's tokens) with an :class:`Episodes` describing it: which tokens are the model's (the only ones the loss
and the KL count), whether each episode ended by itself, its messages (what reward functions and the judge
read), its tool statistics, and the environment's reward when one owns it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from rloo.agents.environments import (
    Environment,
    EnvironmentPool,
    environment_rewards,
    load_environment,
    reset_all,
    with_observation,
)
from rloo.agents.tools import Tool, ToolCall, load_tools, parse_tool_calls, run_calls
from rloo.errors import UserError
from rloo.generation import Generated, Generator, SamplingParams, left_pad

# the seeds of turn t are the first turn's moved by t times this (odd) constant: distinct streams per turn
_TURN_SEED_STEP = 0x9E3779B9
_PROBE_RESULT = "rloo probe result 7031"


@dataclass
class Episodes:
    """What a batch of episodes was, beyond its tokens; every list and tensor has one entry per episode (B)."""

    policy_mask: torch.Tensor  # (B, T) bool: the model's own tokens (the tools' results are False)
    lengths: torch.Tensor  # (B,) long: the episode's tokens, the tools' included
    finished: torch.Tensor  # (B,) bool: the last turn ended with the stop token
    tool_calls: torch.Tensor  # (B,) long: calls the model made
    tool_errors: torch.Tensor  # (B,) long: calls whose result is an error message
    turns: torch.Tensor  # (B,) long: the model's turns
    messages: list[list[dict[str, Any]]]  # the episode after the prompt: assistant and tool messages
    prompt_ids: list[list[int]]  # (P,) each prompt as the episodes saw it (with the environment's text)
    prompts: list[Any]  # (P,) the dataset's prompt with the environment's text
    env_rewards: list[float | None] | None = None  # (B,) the environment's get_reward() at the end


@dataclass
class _Episode:
    context: list[int]  # the prompt and everything after it
    prompt_len: int
    budget: int  # tokens allowed after the prompt
    tools: dict[str, Tool]
    policy: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    calls: int = 0
    errors: int = 0
    turns: int = 0
    finished: bool = False

    @property
    def used(self) -> int:
        return len(self.context) - self.prompt_len


def tool_suffix_ids(tokenizer: Any, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The tokens the chat template puts after an assistant turn (its stop token included) for these tool
    messages, through the next assistant turn's generation prompt: the difference between a dummy
    conversation rendered with and without them, cut at the dummy turn's last EOS (templates such as Qwen's
    put a newline after it that the model never samples)."""
    calls = [
        {"type": "function", "function": {"name": tool_messages[0].get("name", "tool"), "arguments": {}}}
    ]
    dummy: list[dict[str, Any]] = [
        {"role": "user", "content": "dummy"},
        {"role": "assistant", "content": "", "tool_calls": calls},
    ]
    prefix = _render(tokenizer, dummy, add_generation_prompt=False)
    full = _render(tokenizer, dummy + tool_messages, add_generation_prompt=True)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise UserError(
            "the chat template renders an assistant turn differently once tool messages follow it, so a "
            "multi-turn episode's tokens would not be the ones sampled; use a template that leaves earlier turns "
            "as they are (Qwen2.5/Qwen3's do)."
        )
    return full[len(prefix) :]


def _render(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> list[int]:
    try:
        out = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
        )
    except Exception as e:
        reason = " ".join(str(e).split())
        raise UserError(
            f"the chat template cannot render tool messages ({type(e).__name__}: {reason}); use a tool-calling "
            "model's template (one that renders role 'tool')."
        ) from None
    return list(out["input_ids"] if isinstance(out, dict) else out)


def check_template(tokenizer: Any) -> None:
    """One line now, not mid-run, when the tokenizer cannot hold episodes: no chat template, a template that
    re-renders earlier turns, or one that drops tool messages."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise UserError(
            "--tools and --environment need a chat template (the tools are described in it and their results "
            "sent back through it); use a chat model's tokenizer."
        )
    suffix = tool_suffix_ids(tokenizer, [{"role": "tool", "name": "probe", "content": _PROBE_RESULT}])
    if _PROBE_RESULT not in tokenizer.decode(suffix):
        raise UserError(
            "the chat template drops tool messages (role 'tool'), so the model would never see a tool's result; "
            "use a tool-calling model's template."
        )


class EpisodeRunner:
    """Runs a batch of episodes on a generator: ``tools`` for every episode, an ``environment``'s instance per
    episode (its tools and reward), at most ``max_iterations`` rounds of tool calls, each round's calls under
    ``tool_timeout`` seconds, ``budget`` tokens after the prompt."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        tools: Sequence[Tool],
        environment: Environment | None,
        max_iterations: int | None,
        tool_timeout: float,
        budget: int,
        max_prompt_length: int | None = None,
    ) -> None:
        check_template(tokenizer)
        clash = sorted({t.name for t in tools} & set(environment.schemas if environment is not None else ()))
        if clash and environment is not None:
            raise UserError(
                f"--tools and --environment {environment.name} both give a tool named {clash[0]!r}: the model "
                "calls tools by name; rename one, or drop it from --tools."
            )
        self.tokenizer = tokenizer
        self.tools = list(tools)
        self.environment = environment
        self.pool = EnvironmentPool(environment) if environment is not None else None
        self.max_iterations = max_iterations
        self.tool_timeout = tool_timeout
        self.budget = budget
        self.max_prompt_length = max_prompt_length

    @property
    def owns_reward(self) -> bool:
        """The environment scores the episodes (its ``get_reward``): one more reward source."""
        return self.environment is not None and self.environment.owns_reward

    def schemas(self) -> list[dict[str, Any]]:
        """Every tool's schema as the chat template shows it: ``--tools``, then the environment's methods."""
        out = [t.schema for t in self.tools]
        if self.environment is not None:
            out += list(self.environment.schemas.values())
        return out

    def run(
        self,
        generator: Generator,
        prompt_ids: list[list[int]],
        k: int,
        params: SamplingParams,
        seeds: torch.Tensor,
        *,
        return_logprobs: bool,
        prompts: Sequence[Any] | None = None,
        rows: Sequence[dict[str, Any]] | None = None,
        device: torch.device | None = None,
    ) -> Generated:
        """K episodes of each prompt (``prompt_ids``, P lists; ``seeds`` (P*K,) as for one turn). With an
        environment, ``rows`` (P) are the dataset rows its instances are reset with and ``prompts`` (P) the
        dataset's chat prompts its text is appended to."""
        if params.stop_token_id is None:
            raise ValueError("episodes need a stop token to end a turn")
        instances: list[Any] = []
        tools_of = [{t.name: t for t in self.tools} for _ in range(len(prompt_ids) * k)]
        prompt_ids, prompts_seen = list(prompt_ids), list(prompts or [None] * len(prompt_ids))
        if self.pool is not None and self.environment is not None:
            instances = self.pool.take(len(prompt_ids) * k)
            prompt_ids, prompts_seen = self._reset(instances, prompt_ids, prompts_seen, rows, k)
            for b, inst in enumerate(instances):
                tools_of[b].update({t.name: t for t in self.environment.tools(inst)})
        episodes = [
            _Episode(list(prompt_ids[b // k]), len(prompt_ids[b // k]), self.budget, tools_of[b])
            for b in range(len(prompt_ids) * k)
        ]
        ids, mask = left_pad(prompt_ids, params.pad_token_id, device)
        gen = generator.generate(ids, mask, k, params, seeds, return_logprobs=return_logprobs)
        active = list(range(len(episodes)))
        iteration = 0
        while True:
            self._take_turn(episodes, active, gen, params.stop_token_id)
            calling = self._calling(episodes, active, iteration)
            active = self._run_tools(episodes, calling)
            if not active:
                break
            iteration += 1
            ids, mask = left_pad([episodes[b].context for b in active], params.pad_token_id, device)
            turn_seeds = (seeds[active] + iteration * _TURN_SEED_STEP) & 0xFFFFFFFF  # (A,)
            room = max(episodes[b].budget - episodes[b].used for b in active)
            turn = replace(params, max_new_tokens=room)
            gen = generator.generate(ids, mask, 1, turn, turn_seeds, return_logprobs=return_logprobs)
        rewards = environment_rewards(instances) if self.owns_reward else None
        return self._collect(
            episodes, prompt_ids, prompts_seen, rewards, return_logprobs, params.pad_token_id
        )

    def _reset(
        self,
        instances: list[Any],
        prompt_ids: list[list[int]],
        prompts: list[Any],
        rows: Sequence[dict[str, Any]] | None,
        k: int,
    ) -> tuple[list[list[int]], list[Any]]:
        """Each instance reset with its prompt's row; where ``reset`` returned text, the prompt with it appended
        (the K episodes of a prompt share it: the leave-one-out baseline compares them on one task)."""
        rows = rows or [{} for _ in prompt_ids]
        out_ids, out_prompts = list(prompt_ids), list(prompts)
        for p, row in enumerate(rows):
            seen = reset_all(instances[p * k : (p + 1) * k], [row] * k)
            if any(s != seen[0] for s in seen):
                raise UserError(
                    f"--environment {self.environment.name}: reset returned different text for the {k} "  # type: ignore[union-attr]
                    "episodes of one prompt; they share the prompt (the leave-one-out baseline compares them on "
                    "one task): make reset's text depend on the row only (seed any randomness from it)."
                )
            if seen[0] is None:
                continue
            if not isinstance(prompts[p], list):
                raise UserError(
                    f"--environment {self.environment.name}: reset returned text to append to the prompt, but "  # type: ignore[union-attr]
                    "the dataset's prompts are plain text; use chat prompts (a list of messages)."
                )
            out_prompts[p] = with_observation(prompts[p], seen[0])
            ids = self.tokenizer.apply_chat_template(
                out_prompts[p],
                tools=self.schemas(),
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
            out_ids[p] = ids[-self.max_prompt_length :] if self.max_prompt_length else ids
        return out_ids, out_prompts

    def _take_turn(self, episodes: list[_Episode], active: list[int], gen: Generated, stop: int) -> None:
        """Append each active episode's sampled turn (through its stop token, within its budget)."""
        tokens = gen.tokens.cpu()  # (A, T)
        logprobs = gen.logprobs.float().cpu() if gen.logprobs is not None else None  # (A, T)
        for i, b in enumerate(active):
            ep = episodes[b]
            row = tokens[i].tolist()
            end = row.index(stop) + 1 if stop in row else len(row)
            end = min(end, ep.budget - ep.used)
            turn = row[:end]
            ep.context += turn
            ep.policy += [True] * len(turn)
            ep.logprobs += logprobs[i, :end].tolist() if logprobs is not None else [0.0] * len(turn)
            ep.turns += 1
            ep.finished = bool(turn) and turn[-1] == stop
            text = self.tokenizer.decode(turn[:-1] if ep.finished else turn, skip_special_tokens=False)
            ep.messages.append({"role": "assistant", "content": text})

    def _calling(
        self, episodes: list[_Episode], active: list[int], iteration: int
    ) -> list[tuple[int, list[ToolCall]]]:
        """The episodes whose last turn ended by itself with tool calls, while iterations are left."""
        if self.max_iterations is not None and iteration >= self.max_iterations:
            return []
        out = []
        for b in active:
            ep = episodes[b]
            if not ep.finished:
                continue
            calls = parse_tool_calls(ep.messages[-1]["content"], self.tokenizer)
            if calls:
                ep.messages[-1]["tool_calls"] = [
                    {"type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls
                ]
                out.append((b, calls))
        return out

    def _run_tools(self, episodes: list[_Episode], calling: list[tuple[int, list[ToolCall]]]) -> list[int]:
        """Run every calling episode's calls at once and append their messages' tokens; the episodes that go on
        (a result that does not fit the budget ends its episode before it)."""
        jobs = [(call, episodes[b].tools) for b, calls in calling for call in calls]
        results = iter(run_calls(jobs, timeout=self.tool_timeout))
        going = []
        for b, calls in calling:
            ep = episodes[b]
            messages = [{"role": "tool", "name": c.name, "content": next(results)} for c in calls]
            ep.calls += len(calls)
            ep.errors += sum(m["content"].startswith("error:") for m in messages)
            suffix = tool_suffix_ids(self.tokenizer, messages)
            if ep.used + len(suffix) >= ep.budget:  # no room for the results and a token of answer
                continue
            ep.context += suffix
            ep.policy += [False] * len(suffix)
            ep.logprobs += [0.0] * len(suffix)
            ep.messages += messages
            going.append(b)
        return going

    def _collect(
        self,
        episodes: list[_Episode],
        prompt_ids: list[list[int]],
        prompts: list[Any],
        rewards: list[float | None] | None,
        return_logprobs: bool,
        pad: int,
    ) -> Generated:
        width = max(1, max(ep.used for ep in episodes))
        tokens = torch.full((len(episodes), width), pad, dtype=torch.long)  # (B, T)
        policy = torch.zeros((len(episodes), width), dtype=torch.bool)  # (B, T)
        logprobs = torch.zeros((len(episodes), width), dtype=torch.float32)  # (B, T)
        for b, ep in enumerate(episodes):
            n = ep.used
            tokens[b, :n] = torch.tensor(ep.context[ep.prompt_len :], dtype=torch.long)
            policy[b, :n] = torch.tensor(ep.policy, dtype=torch.bool)
            logprobs[b, :n] = torch.tensor(ep.logprobs, dtype=torch.float32)
        info = Episodes(
            policy_mask=policy,
            lengths=torch.tensor([ep.used for ep in episodes]),
            finished=torch.tensor([ep.finished for ep in episodes]),
            tool_calls=torch.tensor([ep.calls for ep in episodes]),
            tool_errors=torch.tensor([ep.errors for ep in episodes]),
            turns=torch.tensor([ep.turns for ep in episodes]),
            messages=[ep.messages for ep in episodes],
            prompt_ids=prompt_ids,
            prompts=prompts,
            env_rewards=rewards,
        )
        return Generated(tokens=tokens, logprobs=logprobs if return_logprobs else None, episodes=info)


def episode_text(messages: list[dict[str, Any]]) -> str:
    """An episode as a person reads it (the judge, the sample tables): each turn on its own line, the tools'
    results marked as such."""
    lines = []
    for m in messages:
        if m["role"] == "tool":
            lines.append(f"[{m.get('name', 'tool')} returned] {m['content']}")
        else:
            lines.append(str(m["content"]).strip())
    return "\n".join(lines)


class AgentSettings(Protocol):
    """The episode settings a command declares (``rloo train``'s and ``rloo eval``'s configs, alike)."""

    tools: list[str]
    environment: str | None
    max_tool_calling_iterations: int | None
    tool_timeout: float


def make_episode_runner(
    tokenizer: Any, settings: AgentSettings, *, budget: int, max_prompt_length: int | None = None
) -> EpisodeRunner | None:
    """The runner of ``--tools`` and ``--environment`` (import paths, loaded and checked now, with the chat
    template), or None when neither is given: single-turn rollouts. ``budget``: tokens after the prompt."""
    if not settings.tools and settings.environment is None:
        return None
    return EpisodeRunner(
        tokenizer,
        tools=load_tools(settings.tools),
        environment=load_environment(settings.environment) if settings.environment is not None else None,
        max_iterations=settings.max_tool_calling_iterations,
        tool_timeout=settings.tool_timeout,
        budget=budget,
        max_prompt_length=max_prompt_length,
    )
