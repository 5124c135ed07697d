"""The one-layer heads' training loop: bfloat16 autocast where asked (`auto`: where the device
multiplies bfloat16 natively), the fused optimizer, and a loss that goes down either way."""

import pytest
import torch
from torch import nn

from draftwise.errors import InvalidParameterError
from draftwise.speculative.heads import training
from draftwise.speculative.heads.training import Example, TrainSettings, train_epochs


def examples(count: int = 6) -> list[Example]:
    generator = torch.Generator().manual_seed(0)
    return [Example(torch.arange(12), 4, torch.randn(12, 8, generator=generator)) for _ in range(count)]


def run(bf16: bool | None) -> tuple[list[bool], list[float]]:
    """Whether each loss was computed under bfloat16 autocast, and the epochs' losses."""
    torch.manual_seed(0)
    head = nn.Linear(8, 8)
    autocast = []

    def loss(example: Example) -> torch.Tensor:
        autocast.append(torch.is_autocast_enabled("cpu"))
        predicted = head(example.hidden[:-1])  # [S-1, 8]: the next position's state
        return (predicted.float() - example.hidden[1:]).pow(2).mean()

    result = train_epochs(head, examples(), examples(2), TrainSettings(epochs=3, batch_size=16, bf16=bf16,
                                                                        learning_rate=1e-2),
                          loss, lambda: [0.0], progress=False)
    return autocast, [report.train_loss for report in result.reports]


@pytest.mark.parametrize("bf16", [True, False])
def test_autocast_as_asked_and_the_loss_goes_down(bf16):
    autocast, losses = run(bf16)
    assert autocast and all(a == bf16 for a in autocast)
    assert losses[-1] < losses[0]


def test_auto_means_where_the_device_multiplies_bfloat16_and_the_default_is_float32(monkeypatch):
    for native in (True, False):
        monkeypatch.setattr(training, "native_bf16", lambda device, native=native: native)
        autocast, _ = run(None)
        assert all(a == native for a in autocast)
    assert TrainSettings().bf16 is False


def test_the_optimizer_is_fused(monkeypatch):
    made = []
    adamw = torch.optim.AdamW
    monkeypatch.setattr(torch.optim, "AdamW", lambda *args, **kwargs: made.append(kwargs) or adamw(*args, **kwargs))
    run(False)
    assert made and made[0].get("fused") is True


def test_a_resumed_run_ends_where_the_uninterrupted_run_does(tmp_path):
    """Interrupted after its first epoch and resumed, a run shuffles its later epochs as it would have
    (it shuffled them from the seed again) and ends with the same weights."""

    def trained(checkpoint, stop_after: int | None = None) -> torch.Tensor:
        torch.manual_seed(0)
        head = nn.Linear(8, 8)
        calls = []

        def loss(example: Example) -> torch.Tensor:
            calls.append(1)
            if stop_after is not None and len(calls) > stop_after:
                raise KeyboardInterrupt
            return (head(example.hidden[:-1]) - example.hidden[1:]).pow(2).mean()

        train_epochs(head, examples(12), examples(2), TrainSettings(epochs=3, batch_size=8, bf16=False,
                                                                     learning_rate=1e-2),
                     loss, lambda: [0.0], checkpoint=checkpoint, progress=False)
        return head.weight.detach().clone()

    whole = trained(tmp_path / "whole.pt")
    with pytest.raises(KeyboardInterrupt):
        trained(tmp_path / "resumed.pt", stop_after=12 + 3)  # (in the second epoch)
    torch.testing.assert_close(trained(tmp_path / "resumed.pt"), whole, rtol=0, atol=0)


@pytest.mark.parametrize("field, value", [("learning_rate", 0.0), ("learning_rate", float("nan")),
                                          ("heldout_share", 1.0), ("heldout_share", -0.1), ("epochs", 0),
                                          ("batch_size", True), ("weight_decay", -1.0), ("head_width", 0)])
def test_bad_training_settings_are_refused_by_name(field, value):
    from draftwise.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match=field):
        TrainSettings(**{field: value})


def test_a_checkpoint_of_a_run_with_other_settings_or_data_is_not_resumed(tmp_path):
    """Resumed into another run, a checkpoint would carry its schedule's length (epochs) or its
    vocabulary's rows over: refused by what differs; a save leaves no partial file behind."""
    def run(settings: TrainSettings, count: int = 12) -> None:
        head = nn.Linear(8, 8)
        train_epochs(head, examples(count), examples(2), settings,
                     lambda e: (head(e.hidden[:-1]) - e.hidden[1:]).pow(2).mean(), lambda: [0.0],
                     checkpoint=tmp_path / "checkpoint.pt", progress=False)

    run(TrainSettings(epochs=1, batch_size=8, bf16=False))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
    with pytest.raises(InvalidParameterError, match="made with other epochs"):
        run(TrainSettings(epochs=3, batch_size=8, bf16=False))
    with pytest.raises(InvalidParameterError, match="made with other training examples"):
        run(TrainSettings(epochs=1, batch_size=8, bf16=False), count=10)
