"""`draftwise train-head`: distil the target's answers to the prompts, train a head, save it.

Which heads can be trained is the registry's to say (a drafter with `train`). Where the head goes:
`out`, else the cache folder its drafter looks in for this target (`heads.store.default_folder`),
so `{"method": KIND}` then finds it.
"""

from __future__ import annotations

from pathlib import Path

from draftwise.errors import InvalidParameterError
from draftwise.llm import LLM
from draftwise.loading.registry import KNOWN_MODELS
from draftwise.output_paths import output_folder
from draftwise.speculative.heads.store import default_folder
from draftwise.speculative.heads.training import TrainResult, TrainSettings
from draftwise.speculative.registry import all_specs
from draftwise.traffic import read_traffic
from draftwise.training.distill import CHUNK, distill_cached


def train_head(target: str, kind: str, data: str, out: Path | None = None, *, settings: TrainSettings | None = None,
               sample: int = 64, max_tokens: int = 128, progress: bool = True,
               **model_keywords) -> tuple[Path, TrainResult]:
    specs = {spec.name: spec for spec in all_specs() if spec.train is not None}
    if kind not in specs:
        raise InvalidParameterError(f"--kind {kind!r} cannot be trained; heads that can: {', '.join(specs)}")
    settings = settings or TrainSettings()
    if min(sample, max_tokens) < 1:  # (the settings check their own values: TrainSettings.__post_init__)
        raise InvalidParameterError(f"sample and max_tokens must be positive, got {sample} and {max_tokens}")
    unread = [flag for field, flag, default in (("head_width", "--head-width", None), ("bf16", "--precision", False))
              if getattr(settings, field) != default and field not in specs[kind].train_reads]
    if unread:
        raise InvalidParameterError(f"{', '.join(unread)}: not read when training a {kind} head")
    data_path = Path(data)
    if not data_path.is_file():  # (before the target loads: on a fresh machine that is a download)
        raise InvalidParameterError(f"--data {data}: " + ("a folder, not a JSONL file of prompts" if data_path.is_dir()
                                                          else "no such file"))
    folder = output_folder(Path(out) if out is not None else default_folder(kind, target), "--out")  # (before the work)
    llm = LLM(target, max_num_seqs=CHUNK, progress=progress, **model_keywords)  # a chunk of prompts answered as a batch
    items = read_traffic(data, llm.tokenizer, sample=sample, max_tokens=max_tokens)
    if not items:
        raise InvalidParameterError(f"{data}: no prompts to train on")
    spec = specs[kind]
    aux_layers = spec.train_layers(llm.model.config) if spec.train_layers is not None else ()
    identity = target if target in KNOWN_MODELS else weights_identity(llm.model_folder)  # (known: pinned by sha256)
    examples, cached = distill_cached(llm, {"target": identity, **model_keywords},
                                      [item.prompt for item in items], max_tokens, progress, aux_layers)
    if progress:
        print(f"target answers: {cached}")
    notes = {"data": str(data), "prompts": len(examples), "max_tokens": max_tokens}
    result = spec.train(llm.model, llm.tokenizer, target, examples, settings, folder, notes, progress)
    return folder, result


def weights_identity(folder: Path) -> list:
    """The model folder the target was loaded from (absolute) and its config's and weights' sizes and
    times: answers distilled from other weights (another model of the same name, a folder whose
    weights were replaced, "." run elsewhere) are never taken for this one's."""
    files = sorted([folder / "config.json", *folder.glob("*.safetensors")])
    return [str(folder.resolve()), *[(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]]
