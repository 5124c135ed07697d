"""Self-distillation data: the target answers the prompts, and its hidden states are read back.

What a head learns should be what verification accepts, and verification accepts the target's own
greedy tokens: so the training text is the target's answers (not a dataset's), and the features are
the target's hidden states over prompt + answer (after its final norm, as its LM head reads them).

Answering is the slow part of training (seconds a prompt on a CPU), so the target answers CHUNK
prompts at a time as one batch (greedy answers do not depend on the batch: the same tokens as one at
a time; measured on the 1.5B on a 2-core CPU, 16 prompts of 128 tokens: 51.5 tokens/s against 14.5),
and the states are those its passes computed while it answered (`LLM.recording_hidden`; an answer
the context cut short is read again in one teacher-forced pass, `hidden_states`, as its last token
was never fed). The examples are cached, keyed by the target, how it was loaded, the prompts and
the answer length: a second head (another kind, width or schedule) trained on the same traffic
starts at once. Each chunk's answers are written beside the cache file as they come, so an
interrupted run (an hour of answers on a CPU) resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from draftwise.llm import LLM
from draftwise.paths import cache_root
from draftwise.sampling.params import SamplingParams
from draftwise.speculative.heads.training import Example

FORMAT = 2  # bump when what an example holds changes (2: states recorded while the target answers)
CHUNK = 16  # prompts answered as one batch and written together: an interrupted run resumes after the last chunk


def distill(llm: LLM, prompts: list, max_tokens: int, progress: bool = True, aux_layers: tuple[int, ...] = (),
            done: int = 0, on_chunk: Callable[[list[Example]], None] | None = None) -> list[Example]:
    """One example per prompt: the target's greedy answer and its hidden states over it all (and the
    residual streams after `aux_layers`, side by side, where a head's training reads them). done:
    prompts answered earlier (skipped, counted in the progress bar); on_chunk: given every CHUNK
    new examples as they are made (and the last few)."""
    # One token more than kept, and on past EOS: the pass that feeds the answer's last kept token
    # (its EOS, or its max_tokens-th) records its state too. Greedy tokens up to EOS are the same as a
    # request that stops there would get; a row running on costs a few ms a step in the batch, where
    # a second pass over a 600-token prompt would cost seconds.
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens + 1, ignore_eos=True)
    stops = frozenset(llm.tokenizer.eos_token_ids)
    last = llm.model.config.num_hidden_layers - 1
    examples = []
    bar = tqdm(desc="target answers", disable=not progress, unit="prompt", initial=done, total=len(prompts))
    for first in range(done, len(prompts), CHUNK):
        chunk = []
        with llm.recording_hidden((last, *aux_layers)) as recorder:
            outputs = llm.generate(prompts[first:first + CHUNK], params)  # one batch (the LLM's max_num_seqs)
        for output in outputs:
            answer = list(output.token_ids)[:max_tokens]
            end = next((i + 1 for i, token in enumerate(answer) if token in stops), len(answer))  # (EOS kept)
            ids = list(output.prompt_token_ids) + answer[:end]
            states = recorder.take(output.request_id)
            if len(states.get(last, ())) >= len(ids):
                hidden, aux = recorded_states(llm, states, len(ids), last, aux_layers)
            else:  # an answer the context cut short: its last token was never fed
                hidden, aux = hidden_states(llm, ids, aux_layers)
            chunk.append(Example(torch.tensor(ids), len(output.prompt_token_ids), hidden, aux))
        if on_chunk is not None:
            on_chunk(chunk)
        examples += chunk
        bar.update(len(chunk))
    bar.close()
    return examples


@torch.inference_mode()
def recorded_states(llm: LLM, states: dict[int, torch.Tensor], length: int, last: int,
                    aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`hidden_states`' two results from the states recorded while the target answered: [S, H] the last
    layer's after the final norm, [S, L*H] bfloat16 the streams after `aux_layers` (None without)."""
    hidden = llm.model.norm(states[last][:length]).float().cpu()
    aux = torch.cat([states[layer][:length] for layer in aux_layers], dim=-1).to(torch.bfloat16).cpu() if aux_layers else None
    return hidden, aux


def distilled_folder() -> Path:
    return cache_root() / "distilled"


def distill_cached(llm: LLM, key: dict, prompts: list, max_tokens: int, progress: bool = True,
                   aux_layers: tuple[int, ...] = ()) -> tuple[list[Example], Path]:
    """`distill`, read from the cache when the same target (as `key` describes its loading) answered
    the same prompts before (with the same layers read); written there otherwise. Returns the
    examples and the cache file."""
    described = {"format": FORMAT, "model": key, "prompts": prompts, "max_tokens": max_tokens}
    if aux_layers:
        described["aux_layers"] = list(aux_layers)
    identity = json.dumps(described, sort_keys=True, default=str)
    path = distilled_folder() / (hashlib.sha256(identity.encode()).hexdigest()[:24] + ".safetensors")
    chunks = sorted(path.parent.glob(path.stem + ".chunk-*.safetensors"))  # an interrupted run's answers
    if path.is_file():
        try:
            examples = read_examples(path)
            for chunk in chunks:  # (left by a run stopped between its last write and this clean-up)
                chunk.unlink(missing_ok=True)
            return examples, path
        except (OSError, SafetensorError, KeyError, ValueError):
            path.unlink(missing_ok=True)  # a torn write: answer again
    done: list[Example] = []
    kept = 0
    for chunk in chunks:
        try:
            if chunk.name != _chunk_path(path, kept).name:
                raise ValueError("a chunk missing")
            done += read_examples(chunk)
            kept += 1
        except (OSError, SafetensorError, KeyError, ValueError):
            for stale in chunks[kept:]:
                stale.unlink(missing_ok=True)
            break
    written = [kept]  # the next chunk's number

    def keep(chunk: list[Example]) -> None:
        write_examples(_chunk_path(path, written[0]), chunk)
        written[0] += 1

    examples = done + distill(llm, prompts, max_tokens, progress, aux_layers, done=len(done), on_chunk=keep)
    write_examples(path, examples)
    for chunk in path.parent.glob(path.stem + ".chunk-*.safetensors"):
        chunk.unlink(missing_ok=True)
    return examples, path


def _chunk_path(path: Path, number: int) -> Path:
    return path.with_name(f"{path.stem}.chunk-{number:05d}.safetensors")


def write_examples(path: Path, examples: list[Example]) -> None:
    if not examples:
        return  # (nothing to keep: the caller refuses an empty data set)
    path.parent.mkdir(parents=True, exist_ok=True)
    lengths = torch.tensor([len(e.token_ids) for e in examples], dtype=torch.long)  # [E]
    tensors = {"token_ids": torch.cat([e.token_ids for e in examples]).long(),  # [sum S]
               "hidden": torch.cat([e.hidden for e in examples]).float().contiguous(),  # [sum S, H]
               "lengths": lengths, "answer_starts": torch.tensor([e.answer_start for e in examples])}
    if examples[0].aux is not None:
        tensors["aux"] = torch.cat([e.aux for e in examples]).contiguous()  # [sum S, L*H] bfloat16
    partial = path.with_suffix(".partial")
    save_file(tensors, str(partial))
    partial.replace(path)


def read_examples(path: Path) -> list[Example]:
    tensors = load_file(str(path))
    bounds = [0, *torch.cumsum(tensors["lengths"], 0).tolist()]
    aux = tensors.get("aux")
    return [Example(tensors["token_ids"][a:b], int(start), tensors["hidden"][a:b], None if aux is None else aux[a:b])
            for a, b, start in zip(bounds, bounds[1:], tensors["answer_starts"].tolist())]


@torch.inference_mode()
def hidden_states(llm: LLM, token_ids: list[int],
                  aux_layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[S, H] the target's last hidden states over `token_ids` after its final norm (teacher-forced,
    one pass, no cache), and [S, L*H] bfloat16 its residual streams after `aux_layers` (None without)."""
    model = llm.model
    tokens = torch.tensor([token_ids], device=model.norm.weight.device)  # [1, S]
    positions = torch.arange(len(token_ids), device=tokens.device)[None]  # [1, S]
    hidden, captured = model.hidden_states(tokens, positions, capture_layers=tuple(aux_layers))
    aux = torch.cat([captured[layer][0] for layer in aux_layers], dim=-1).to(torch.bfloat16).cpu() if aux_layers else None
    return model.norm(hidden)[0].float().cpu(), aux
