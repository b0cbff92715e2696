"""distill end to end at toy scale on the CPU: prepare -> answers -> train -> a draft the engine loads ->
train --resume goes on from exactly those weights, or adds a fusion module that alone trains; answers for other
prompts are refused."""

import gzip
import json

import numpy as np
import pytest
import torch

from distill import data as distill_data
from distill.answers import read_answers, save_answers
from distill.cli import main
from distill.data import unpack_debs  # the real one: the data fixture replaces the module's
from distill.draft import own_parameters, resumed
from core.io.loading import load_draft
from core.io.samples import held_out_documents


@pytest.fixture(scope="module")
def data(tmp_path_factory, monkeypatch_module):
    out = tmp_path_factory.mktemp("data")
    monkeypatch_module.setattr(distill_data, "unpack_debs", lambda root: {})  # no Debian download in a unit test
    main(["prepare", "--out", str(out), "--prompts", "6", "--val-prompts", "2", "--min-doc", "40",
                  "--max-doc", "80", "--cap-per-group", "3000", "--head-size", "600", "--deb-root", str(out / "debs")])
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


def _train(data, out, *extra):
    main(["train", "--data", str(data), "--answers", str(data / "a.npz"), "--out", str(out), "--steps", "2",
                  "--windows", "4", "--seqs", "2", "--window", "48", "--int8", "--device", "cpu", *extra])
    return json.loads((out / "training.json").read_text())


def test_prepare_answers_train_resume(data, embedded, tmp_path):
    sources = json.loads((data / "sources.json").read_text())
    assert sources["prompts"] == 6 and sources["validation_prompts"] == 2
    assert all(f["group"] != "holdout" for f in sources["files"]) and sources["head_vocab"]["size"] == 600
    held_out = sources["holdout_documents_not_trained_on"]
    assert held_out == held_out_documents() and not any(f["path"].endswith(tuple(held_out)) for f in sources["files"])
    main(["answers", "--data", str(data), "--out", str(data / "a.npz"), "--answer-tokens", "5",
                  "--gen-batch", "4", "--device", "cpu"])
    answers = np.load(data / "a.npz")
    assert len(answers["index"]) == 8 and 0 < np.diff(answers["offsets"]).max() <= 5

    first = _train(data, tmp_path / "d1", "--init", "2+2", "--trial-steps", "0")
    assert first["steps"] == 2 and first["train_sequences"] == 6
    draft, name = load_draft(str(tmp_path / "d1"), embedded.target, embedded.tokenizer, "target",
                             torch.device("cpu"), torch.float32)
    assert len(draft.layers) == 3 and draft.layers[1] is embedded.target.layers[1] and len(draft.vocab_ids) == 600

    again, shared, layers, head_ids = resumed(embedded.target, tmp_path / "d1")
    assert (shared, layers) == (2, [2]) and torch.equal(head_ids, draft.vocab_ids)
    own = own_parameters(again, shared)
    assert set(own) == {k for k, _ in draft.named_parameters() if k.startswith(("layers.2.", "norm."))}
    for k, v in own.items():  # training goes on from the stored (int8-rounded) weights, not from the target's
        assert torch.equal(v, dict(draft.named_parameters())[k])
    second = _train(data, tmp_path / "d2", "--resume", str(tmp_path / "d1"))
    assert second["val_before"]["kl"] == pytest.approx(first["val_after"]["kl"], rel=0.05)
    config = json.loads((tmp_path / "d2" / "config.json").read_text())["triforce_draft"]
    assert config["resumed_from"] == str(tmp_path / "d1") and config["head_vocab"]["size"] == 600


def test_answers_files_add_up_and_other_prompts_are_refused(data, tmp_path):
    prompts, _ = distill_data.load_prompts(data, 0)
    save_answers(tmp_path / "a.npz", prompts, [([1, 2], 0.0)] + [None] * (len(prompts) - 1))
    save_answers(tmp_path / "b.npz", prompts, [([3], 0.5), ([4, 5], 1.0)] + [None] * (len(prompts) - 2))
    both = read_answers([str(tmp_path / "a.npz"), str(tmp_path / "b.npz")], prompts)
    assert both[:3] == [[([1, 2], 0.0), ([3], 0.5)], [([4, 5], 1.0)], []]
    with pytest.raises(ValueError, match="other prompts"):
        read_answers([str(tmp_path / "a.npz")], [[9, 9, 9]] + prompts[1:])


def test_fusion_trains_only_its_module_and_loads(data, embedded, tmp_path):
    if not (data / "a.npz").exists():
        main(["answers", "--data", str(data), "--out", str(data / "a.npz"), "--answer-tokens", "5",
                      "--gen-batch", "4", "--device", "cpu"])
    _train(data, tmp_path / "d1", "--init", "2+2", "--trial-steps", "0")
    fused = _train(data, tmp_path / "d2", "--resume", str(tmp_path / "d1"), "--fusion", "32", "--fusion-ages", "3",
                   "--lr", "1e-2")
    before, after = fused["val_before"], fused["val_after"]
    # a new fusion module leaves the draft as it was: every age starts at the plain draft's agreement
    assert before["top1"] == before["top1_age1"] == before["top1_age2"] == before["top1_age3"]
    assert after["top1"] == before["top1"]  # the body did not train
    assert after["kl"] != before["kl"]
    config = json.loads((tmp_path / "d2" / "config.json").read_text())["triforce_draft"]
    assert config["fusion"]["hidden"] == 32 and config["fusion"]["ages"] == 3
    plain, _ = load_draft(str(tmp_path / "d1"), embedded.target, embedded.tokenizer, "target", torch.device("cpu"),
                          torch.float32)
    draft, name = load_draft(str(tmp_path / "d2"), embedded.target, embedded.tokenizer, "target",
                             torch.device("cpu"), torch.float32)
    assert draft.fusion is not None and "fused" in name
    for k, v in plain.named_parameters():  # the body did not move: only the fusion module trained
        assert torch.equal(v, dict(draft.named_parameters())[k]), k
    h, feature = torch.randn(2, draft.args.dim), torch.randn(draft.args.dim)
    assert not torch.allclose(draft.fusion(h, feature, 1), h) and not torch.allclose(draft.fusion(h, feature, 1),
                                                                                     draft.fusion(h, feature, 2))


def test_debian_packages_are_fetched_once_and_read_as_text(tmp_path, monkeypatch):
    calls = []

    def fake_run(cmd, cwd=None, **kw):  # apt-get download writes NAME_VERSION_all.deb files; dpkg -x unpacks one
        calls.append(cmd[:2])
        if cmd[0] == "apt-get":
            for name in cmd[2:]:
                (tmp_path / f"{name}_1%3a2.0_all.deb").write_bytes(b"")

    monkeypatch.setattr(distill_data.subprocess, "run", fake_run)
    monkeypatch.setattr(distill_data, "DEBS", ["a-doc", "b-doc"])
    assert unpack_debs(tmp_path) == {"a-doc": "1:2.0", "b-doc": "1:2.0"}
    monkeypatch.setattr(distill_data, "DEBS", ["a-doc", "b-doc", "c-doc"])
    calls.clear()
    assert unpack_debs(tmp_path)["c-doc"] == "1:2.0"
    assert calls == [["apt-get", "download"], ["dpkg", "-x"]] and not list(tmp_path.glob("*.deb"))
    calls.clear()
    unpack_debs(tmp_path)
    assert calls == []  # all there: nothing downloaded

    (tmp_path / "guide.txt.gz").write_bytes(gzip.compress("plain text".encode()))
    (tmp_path / "page.html").write_text("<nav>Prev Next</nav><h1>Title</h1><p>Body &amp; more</p>")
    assert distill_data._text(tmp_path / "guide.txt.gz") == "plain text"
    assert distill_data._text(tmp_path / "page.html") == "Title\n\nBody & more"
