"""Tensor parallelism on CPUs (gloo, 2 processes): the shards' logits equal one process's, greedy runs (on-chip and
offloaded, TriForce and AR) give one process's tokens, sampled TriForce stays exact, and `--tp 2` on the command
line prints what one process prints."""

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from core.cli.main import main
from core.config import GenerationConfig, TriForceError
from core.engine import Engine
from core.events import Finished
from core.cache.kvcache import KVCache
from core.model.parallel import TensorParallel, joined, launch, parallelize, shard
from tests.stats import chi_square_p
from tests.lossless import CFG, emitted_pairs, target_pairs, tiny_engine
from tests.tiny import tiny_config, tiny_pair

WORLD = 2
TIMEOUT_S = 600  # a hung collective fails the test instead of blocking it (about 60 s on an idle 2-core machine)
DRAWS = 2000
FAMILIES = ("llama", "qwen2", "qwen3")  # plain, q/k/v biases, q/k norms
GREEDY = {  # name: settings of a greedy run of the tiny engine
    "ar": dict(method="ar"),
    "triforce": dict(),
    "triforce gated": dict(draft_confidence=0.5),
    "ar offloaded": dict(method="ar", offload="on"),
    "triforce offloaded": dict(offload="on"),
}


def logits_of(model) -> torch.Tensor:
    """Logits of a prefill of 20 tokens then steps of 1, 1 and 3 tokens over one cache, stacked [25, V]."""
    a = model.args
    cache = KVCache(a.n_layers, a.n_kv_heads, a.head_dim, 32, torch.float32, model.device)
    ids = torch.randint(0, a.vocab_size, (25,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return torch.cat([model(ids[i:j], cache) for i, j in ((0, 20), (20, 21), (21, 22), (22, 25))])


def greedy_ids(engine: Engine, prompt: list[int]) -> dict[str, list[int]]:
    """The token ids of each GREEDY run."""
    out = {}
    with torch.no_grad():
        for name, extra in GREEDY.items():
            cfg = GenerationConfig(**{**CFG, "max_new_tokens": 16, "greedy": True, **extra}).validate()
            events = engine.generate_ids(prompt, cfg)
            out[name] = next(e for e in events if isinstance(e, Finished)).token_ids
    return out


def _rank(out: str) -> None:
    """One rank's part in every check: the families' logits, the greedy runs, the sampled draws."""
    with joined("cpu") as tp:
        torch.set_num_threads(1)
        result = {}
        for family in FAMILIES:
            _, model = tiny_pair(tiny_config(family), seed=0)
            parallelize(model, None, tp)
            result[family] = logits_of(model)
        result["kv_heads"] = model.args.n_kv_heads
        engine, prompt = tiny_engine()
        parallelize(engine.target, engine.draft, tp)
        result["greedy"] = greedy_ids(engine, prompt)
        with torch.no_grad():
            result["sampled"] = emitted_pairs(engine, prompt, DRAWS)
        torch.save(result, f"{out}/{tp.rank}.pt")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    """What each of WORLD processes computed (one launch for all checks: starting processes is the slow part)."""
    out = tmp_path_factory.mktemp("ranks")
    assert launch(WORLD, _rank, str(out), timeout_s=TIMEOUT_S) == 0
    return [torch.load(out / f"{rank}.pt", weights_only=False) for rank in range(WORLD)]


def test_shards_compute_the_whole_model_logits(ranks):
    for rank in ranks:
        assert rank["kv_heads"] == 1  # each rank's caches hold one of the two KV heads
        for family in FAMILIES:
            _, whole = tiny_pair(tiny_config(family), seed=0)
            torch.testing.assert_close(rank[family], logits_of(whole), atol=1e-5, rtol=1e-5)


def test_greedy_runs_equal_one_process(ranks):
    engine, prompt = tiny_engine()
    want = greedy_ids(engine, prompt)
    assert want["triforce"] == want["ar"] and want["triforce offloaded"] == want["ar"]
    assert [rank["greedy"] for rank in ranks] == [want] * WORLD


def test_sampled_triforce_is_lossless(ranks):
    (counts, levels), other = (rank["sampled"] for rank in ranks)
    assert other == (counts, levels)  # every rank emitted rank 0's tokens
    assert 0 < levels["l1_accepted"] < levels["l1_proposed"]
    assert 0 < levels["l2_accepted"] < levels["l2_proposed"]
    engine, prompt = tiny_engine()
    with torch.no_grad():
        p = chi_square_p(counts, target_pairs(engine, prompt), DRAWS)
    assert p > 1e-3, f"tensor-parallel sampler rejected (p={p:.2e})"


@pytest.mark.parametrize("world, bad", [(3, "query heads (4) and KV heads (2) and MLP width (128)"),
                                        (4, "KV heads (2)")])
def test_indivisible_shapes_are_refused(world, bad):
    _, model = tiny_pair(tiny_config(), seed=0)
    with pytest.raises(TriForceError) as e:
        shard(model, 0, world)
    assert str(e.value) == f"tensor parallel over {world} processes needs {bad} divisible by {world}"


def test_a_draft_keeps_whole_copies_of_the_layers_it_shared_with_the_target():
    _, target = tiny_pair(tiny_config(), seed=0)
    _, draft = tiny_pair(tiny_config(layers=1), seed=1)
    draft.layers[0] = target.layers[0]  # as a distilled draft shares the target's first layers
    whole = target.layers[0].self_attn.q_proj.weight.detach().clone()
    parallelize(target, draft, TensorParallel(1, WORLD, torch.device("cpu"), None))
    assert draft.layers[0] is not target.layers[0] and draft.layers[0].self_attn.args.n_heads == 4
    assert torch.equal(draft.layers[0].self_attn.q_proj.weight, whole)
    assert torch.equal(target.layers[0].self_attn.q_proj.weight, whole[32:])  # rank 1's two query heads


def byte_model_dir(path: Path) -> Path:
    """A tiny random Llama with a byte-level tokenizer (256 bytes + </s>), saved as a transformers checkpoint."""
    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    fast.save_pretrained(path)
    torch.manual_seed(0)
    config = tiny_config(vocab=len(fast), max_position=1024, eos_token_id=fast.eos_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def test_cli_tp_prints_what_one_process_prints(tmp_path, capfd):
    doc = tmp_path / "doc.txt"
    doc.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    argv = ["generate", "--target", str(byte_model_dir(tmp_path / "model")), "--draft", "none", "--doc", str(doc),
            "--prompt", "Who jumps?", "--greedy", "--max-new-tokens", "12", "--budget", "64", "--drafter", "ngram",
            "--json"]
    assert main(argv) == 0
    one = json.loads(capfd.readouterr().out)
    assert main([*argv, "--tp", "2"]) == 0
    out = capfd.readouterr().out
    assert json.loads(out)["token_ids"] == one["token_ids"] and out.count("\n") == 1  # rank 0 alone printed
    assert main([*argv, "--tp", "0"]) == 2 and capfd.readouterr().err == "error: --tp 0: must be at least 1\n"
