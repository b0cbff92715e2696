"""The growing answer: text pieces add up to the decoded text; EOS, stop strings and max_new_tokens stop it."""

from core.config import GenerationConfig
from core.decode.output import Output


def feed(embedded, text: str, cfg: GenerationConfig, eos: set[int] = frozenset(), extra: list[int] = ()):
    ids = embedded.tokenizer(text, add_special_tokens=False)["input_ids"] + list(extra)
    out = Output(embedded.tokenizer, cfg, set(eos))
    pieces = []
    for i in range(0, len(ids), 3):  # several tokens per call, as a verification round emits them
        event = out.add(ids[i:i + 3], ["level2"] * len(ids[i:i + 3]), i)
        pieces += event.texts
        if out.done:
            break
    return out, pieces, ids


def test_pieces_add_up_including_multibyte_characters(embedded):
    text = "Café ☕ naïve — 東京 and ok"
    out, pieces, ids = feed(embedded, text, GenerationConfig(max_new_tokens=100))
    assert "".join(pieces) == out.text == embedded.tokenizer.decode(ids) and not out.done


def test_eos_stops_and_is_not_emitted(embedded):
    eos = embedded.tokenizer.eos_token_id
    out, pieces, ids = feed(embedded, "One two", GenerationConfig(), {eos}, extra=[eos, 42])
    assert out.stop_reason == "eos" and out.ids == ids[:-2] and "".join(pieces) == "One two"


def test_stop_string_cuts_text(embedded):
    out, pieces, _ = feed(embedded, "Alpha beta. END gamma delta", GenerationConfig(stop=["END"]))
    assert out.stop_reason == "stop_string" and out.text == "Alpha beta. " and "".join(pieces) == out.text


def test_max_new_tokens(embedded):
    out, _, ids = feed(embedded, "a b c d e f g h i j", GenerationConfig(max_new_tokens=4))
    assert out.stop_reason == "max_new_tokens" and out.ids == ids[:4]


def test_each_token_decodes_only_a_few_tokens(embedded):
    class Counting:  # the tokenizer, counting the tokens it is asked to decode
        def __init__(self, tok):
            self.tok, self.decoded = tok, 0

        def decode(self, ids, **kw):
            self.decoded += len(ids)
            return self.tok.decode(ids, **kw)

    text = " ".join(["Café ☕ naïve — 東京 and some more words"] * 40)
    ids = embedded.tokenizer(text, add_special_tokens=False)["input_ids"]
    tok = Counting(embedded.tokenizer)
    out = Output(tok, GenerationConfig(max_new_tokens=10_000), set())
    pieces = [p for i in range(len(ids)) for p in out.add([ids[i]], ["level2"], i).texts]
    assert "".join(pieces) == embedded.tokenizer.decode(ids) and len(ids) > 400
    assert tok.decoded < 8 * len(ids)  # decoding the whole answer each time would be len(ids)**2 / 2
