"""Tool-calling conversations for the evaluation tools (`poise bench`, `poise probe-eval`): the tool loop TRL runs in
training, around the evaluation engine (vLLM or transformers, `engines/generation.py`).

A rollout's prompt is rendered with its tools' schema by the tokenizer's chat template, as TRL renders it; a
completion is sampled, its tool calls are parsed and run, and their results follow as `tool` messages; again, until
the model calls no tool, `max_turns` rounds of calls ran (TRL's `max_tool_calling_iterations`) or the token budget is
spent. As in TRL the budget holds the whole rollout, the policy's tokens and the tool results; a tool result that would
pass it is dropped and ends the rollout; the context grows by concatenation (the chat template's tool-result suffix),
never re-rendered, and `tool_mask` marks the tool results' tokens. The tools are:

- a recipe's `tools` / `environment` (`RecipeTools`), run by `engines/tools.py` as in training: killable workers, the
  recipe's `tool_timeout` and `tool_result_tokens`, an error line for a call that raises, hangs or does not fit; the
  calls parsed by TRL's `parse_response`, an environment reset with the row and pooled as TRL pools it;
- a task whose family opens tool sessions (`TaskFamily.tool_session`; bfcl-multi: BFCL's backends replayed to the
  episode's turn), its calls read as its reward reads them, results cut at the same token limit.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field

from trl.chat_template_utils import (
    add_response_schema,
    get_training_chat_template,
    is_chat_template_prefix_preserving,
    parse_response,
)

from poise_trl.core.loading import import_callable
from poise_trl.engines.generation import Engine, Sample
from poise_trl.engines.tool_worker import DEFAULT_TOOL_RESULT_TOKENS, DEFAULT_TOOL_TIMEOUT_S, DEFAULT_TOOL_TURNS
from poise_trl.engines.tools import ToolRuntime, environment_class, environment_tools
from poise_trl.tasks import completion_text, get_family


@dataclass(frozen=True)
class RecipeTools:
    """A recipe's tools and environment (import paths) and the limits training runs them with."""

    tools: tuple[str, ...] = ()
    environment: str | None = None
    max_turns: int = DEFAULT_TOOL_TURNS
    result_tokens: int = DEFAULT_TOOL_RESULT_TOKENS
    timeout_s: float = DEFAULT_TOOL_TIMEOUT_S


class RecipeSession:
    """One rollout's tools: the recipe's tool functions and its environment instance's methods, as TRL hands them
    to a rollout."""

    def __init__(self, toolbox: Toolbox, row: dict, environment=None):
        self.toolbox, self.observation = toolbox, None
        self.tools = {tool.__name__: tool for tool in toolbox.functions}
        if environment is not None:
            self.observation = environment.reset(**row)
            self.tools |= {method.__name__: method for method in environment_tools(environment)}

    def calls(self, text: str, ids: list[int], context: str) -> list[tuple[str, dict]]:
        tokenizer = self.toolbox.tokenizer
        prefix = tokenizer(context, add_special_tokens=False)["input_ids"]  # TRL's parser reads the prompt too
        parsed = parse_response(tokenizer, ids, prefix=prefix, tools=self.toolbox.schema)
        return [(call["function"]["name"], call["function"].get("arguments"))
                for call in parsed.get("tool_calls") or [] if call.get("type") == "function"]

    def call(self, name: str, arguments) -> str:
        try:  # TRL's rule: any failure is an error for the model; engines/tools.py's stand-ins raise its line
            if name not in self.tools:
                raise ValueError(f"Tool {name} not found.")
            return str(self.tools[name](**arguments))
        except Exception as exc:  # noqa: BLE001 - the model reads it
            return str({"error": str(exc)})


class Toolbox:
    """Opens the tools of each rollout (`session(row)`): the recipe's for every row, else those of the row's task
    (`TaskFamily.tool_session`), else none (a one-turn rollout)."""

    def __init__(self, tokenizer, recipe: RecipeTools | None = None):
        self.recipe = recipe or RecipeTools()
        parses = any(getattr(tokenizer, name, None) is not None for name in ("response_template", "response_schema"))
        self.tokenizer = add_response_schema(tokenizer) if recipe and not parses else tokenizer  # as TRL: kept if set
        self.runtime = ToolRuntime(list(self.recipe.tools), self.recipe.environment, self.recipe.timeout_s,
                                   self.recipe.result_tokens, tokenizer)
        functions = [import_callable(path, "tool") for path in self.recipe.tools]
        self.functions = self.runtime.tools(functions) if functions else []
        self.schema, self.pool, self.lent = list(functions), [], 0
        if self.recipe.environment:
            self.environment = self.runtime.environment_factory(environment_class(self.recipe.environment))
            self.pool.append(self.environment())  # as TRL: one instance gives the schema, then serves rollouts
            self.schema += environment_tools(self.pool[0])

        # TRL's tool loop renders with a prefix-preserving template, swapping in its training one where needed
        template = None if is_chat_template_prefix_preserving(tokenizer) else get_training_chat_template(tokenizer)
        self.template_kwargs = ({"tools": self.schema} if self.schema else {}) | (
            {"chat_template": template} if template else {})

    def session(self, row: dict):
        if self.recipe.tools or self.recipe.environment:
            if not self.recipe.environment:
                return RecipeSession(self, row)
            if self.lent == len(self.pool):
                self.pool.append(self.environment())
            self.lent += 1
            return RecipeSession(self, row, self.pool[self.lent - 1])
        family = get_family(row["task"]) if "task" in row else None
        if family is None or family.tool_session is None:
            return None
        return family.tool_session(json.loads(row["verifier"]))

    def give_back(self) -> None:
        """The rollouts of a chunk ended: their environment instances serve the next chunk."""
        self.lent = 0

    def close(self) -> None:
        self.runtime.close()


def tool_suffix(tokenizer, tool_messages: list[dict], chat_template: str | None = None) -> str:
    """What the chat template renders after an assistant message for its tool results, up to the next assistant
    header: the difference of two renderings of a minimal conversation, cut after the prefix's last EOS (what the
    model wrote last), as TRL finds the suffix's ids."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, tokenize=False, chat_template=chat_template)
    full = tokenizer.apply_chat_template(dummy + tool_messages, tokenize=False, add_generation_prompt=True,
                                         chat_template=chat_template)
    eos = tokenizer.eos_token
    prefix = prefix[: prefix.rindex(eos) + len(eos)] if eos and eos in prefix else prefix
    if not full.startswith(prefix):
        raise ValueError("the chat template rewrites earlier messages when tool results follow; tool-calling "
                         "evaluation needs a prefix-preserving template (as TRL's tool loop does)")
    return full[len(prefix):]


@dataclass
class Rollout:
    prompt_index: int
    number: int  # unique among the call's rollouts: its sampling seed
    session: object | None
    context: str  # the rendered prompt and all that followed: the next generation's prompt
    messages: list[dict] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    open: bool = True

    def sample(self) -> Sample:
        return Sample(self.prompt_index, completion_text(self.messages), sum(self.tool_mask),
                      self.finish_reason == "length", self.token_ids, self.finish_reason, self.messages,
                      self.tool_mask)


def turn_seed(seed: int, turn: int) -> int:
    """The first generation samples with `seed` itself; each later one with a seed of its own."""
    return seed if turn == 0 else int.from_bytes(hashlib.sha256(f"{seed}:{turn}".encode()).digest()[:4], "little")


@dataclass
class AgentEngine(Engine):
    """An engine whose samples are tool-calling conversations over `engine` (same `sample` contract), for the rows of
    `rows` (indexed as the prompts); `chunk` rollouts run together (each holds an environment instance)."""

    engine: Engine
    toolbox: Toolbox
    rows: list[dict]
    chunk: int = 32

    @property
    def kind(self) -> str:
        return self.engine.kind

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_turns(self) -> int:
        return self.toolbox.recipe.max_turns

    def sample(self, prompts, num_samples, *, temperature, top_p=1.0, max_new_tokens=256, seed=0, on_batch=None,
               prompt_indices=None) -> list[Sample]:
        indices = list(prompt_indices) if prompt_indices is not None else list(range(len(prompts)))
        jobs = [(i, prompt, j) for i, prompt in zip(indices, prompts, strict=True) for j in range(num_samples)]
        samples = []
        for start in range(0, len(jobs), self.chunk):
            rollouts = [self.open(i, prompt, i * num_samples + j) for i, prompt, j in jobs[start: start + self.chunk]]
            for turn in range(self.max_turns + 1):
                active = [r for r in rollouts if r.open]
                if not active:
                    break
                sampled = self.engine.sample(
                    [r.context for r in active], 1, temperature=temperature, top_p=top_p, seed=turn_seed(seed, turn),
                    max_new_tokens=[max_new_tokens - len(r.token_ids) for r in active],
                    prompt_indices=[r.number for r in active])
                for rollout, generated in zip(active, sampled, strict=True):
                    self.advance(rollout, generated, turn, max_new_tokens)
            self.toolbox.give_back()
            batch = [r.sample() for r in rollouts]
            samples += batch
            if on_batch is not None:
                on_batch(batch)
        return samples

    def open(self, index: int, prompt: list[dict], number: int) -> Rollout:
        session = self.toolbox.session(self.rows[index])
        observation = getattr(session, "observation", None)
        if isinstance(observation, str):  # TRL appends an environment's reset observation to the last message
            prompt = prompt[:-1] + [{**prompt[-1], "content": prompt[-1]["content"] + observation}]
        context = self.tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                                     **self.toolbox.template_kwargs)
        return Rollout(index, number, session, context)

    def advance(self, rollout: Rollout, generated: Sample, turn: int, budget: int) -> None:
        """Add one generation to the rollout; run its calls and add their results while turns and budget last."""
        tokenizer = self.tokenizer
        calls = (rollout.session.calls(generated.text, generated.token_ids, rollout.context)
                 if rollout.session is not None and generated.finish_reason == "stop" else [])
        rollout.token_ids += generated.token_ids
        rollout.tool_mask += [1] * len(generated.token_ids)
        rollout.context += tokenizer.decode(generated.token_ids, skip_special_tokens=False)
        rollout.finish_reason = generated.finish_reason
        message = {"role": "assistant", "content": generated.text}
        rollout.messages.append(message)
        if calls:
            message["tool_calls"] = [{"type": "function", "function": {"name": name, "arguments": arguments}}
                                     for name, arguments in calls]
        if not calls or turn == self.max_turns:
            rollout.open = False
            return
        results = [{"role": "tool", "name": name, "content": rollout.session.call(name, arguments)}
                   for name, arguments in calls]
        if not isinstance(rollout.session, RecipeSession):  # engines/tools.py cut the recipe's results already
            results = [{**result, "content": self.toolbox.runtime.clip(result["content"])} for result in results]
        suffix = tool_suffix(tokenizer, results, self.toolbox.template_kwargs.get("chat_template"))
        suffix_ids = tokenizer(suffix, add_special_tokens=False)["input_ids"]
        if len(rollout.token_ids) + len(suffix_ids) >= budget:  # no room for the results and an answer: TRL drops them
            rollout.open, rollout.finish_reason = False, "length"
            return
        rollout.messages += results
        rollout.token_ids += suffix_ids
        rollout.tool_mask += [0] * len(suffix_ids)
        rollout.context += suffix

    def close(self) -> None:
        self.toolbox.close()


def task_tools(dataset) -> bool:
    """Whether a dataset's rows bring tools of their own (a task family with tool sessions: bfcl-multi)."""
    return "task" in dataset.column_names and any(get_family(task).tool_session for task in set(dataset["task"]))


def tool_calls(sample_messages: list[dict] | None) -> int:
    """Tool calls a conversation made (0 for a one-turn completion)."""
    return sum(len(message.get("tool_calls") or []) for message in sample_messages or [])
