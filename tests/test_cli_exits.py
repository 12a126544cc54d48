"""One error, one exit status, in every command (tensorkv.cli.exits); nothing created or written.

Each case runs every command that reads a store on the same fault and expects the same
status: a store that is not there (3, and nothing created), a URL no backend serves (2), an
LMDB store whose data file is empty (4, and the file left empty), a tag that is not there (3).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from click.testing import CliRunner

import tensorkv
from tensorkv.cli.exits import EXIT_NOT_FOUND, EXIT_STORE, EXIT_USAGE, exit_code_of
from tensorkv.cli.main import main
from tensorkv.errors import (
    ConfigError,
    CorruptStoreError,
    ModelNotFoundError,
    StoreNotFoundError,
    TagNotFoundError,
)

#: Every command that reads a store, ``{url}`` standing for it and ``{out}`` for a file.
COMMANDS = {
    "tags": ["tags", "{url}"],
    "check": ["check", "{url}"],
    "check --verify": ["check", "--verify", "{url}"],
    "gc": ["gc", "{url}"],
    "gc --dry-run": ["gc", "--dry-run", "{url}"],
    "compact": ["compact", "{url}", "v1"],
    "vacuum": ["vacuum", "{url}"],
    "ls": ["ls", "{url}"],
    "ls TAG": ["ls", "{url}", "v1"],
    "show": ["show", "{url}", "w"],
    "search": ["search", "{url}", "emb", "--keys", "1"],
    "stats": ["stats", "{url}", "w"],
    "diff": ["diff", "{url}", "v1", "v1"],
    "export": ["export", "{url}", "w", "--to", "{out}"],
    "view": ["view", "{url}", "--port", "0"],
    "repo ls": ["repo", "ls", "{url}"],
    "repo show": ["repo", "show", "{url}", "0123"],
    "repo stats": ["repo", "stats", "{url}"],
    "repo check": ["repo", "check", "{url}"],
    "repo gc": ["repo", "gc", "{url}"],
    "repo rm": ["repo", "rm", "{url}", "0123"],
}
#: The commands that take a tag, with ``nope`` (a tag that is not there) put in.
TAGGED = {
    "compact": ["compact", "{url}", "nope"],
    "ls TAG": ["ls", "{url}", "nope"],
    "show": ["show", "{url}", "w", "--tag", "nope"],
    "search": ["search", "{url}", "emb", "--keys", "1", "--tag", "nope"],
    "stats": ["stats", "{url}", "w", "--tag", "nope"],
    "diff": ["diff", "{url}", "v1", "nope"],
    "export": ["export", "{url}", "w", "--to", "{out}", "--tag", "nope"],
    "view": ["view", "{url}", "--port", "0", "--tag", "nope"],
}


def run(args: list[str], url: str, tmp_path) -> tuple[int, str]:
    """Exit status and stderr of ``tensorkv ARGS`` (in this process)."""
    out = str(tmp_path / "out.npz")
    res = CliRunner().invoke(main, [a.format(url=url, out=out) for a in args])
    assert "Traceback" not in res.output
    return res.exit_code, res.stderr


def one_line_error(stderr: str) -> bool:
    return stderr.startswith("tensorkv: error: ") and len(stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_store_that_is_not_there_is_not_found_and_not_created(name, tmp_path):
    path = tmp_path / "typo" / "deeper"
    code, err = run(COMMANDS[name], f"lmdb://{path}", tmp_path)
    assert code == EXIT_NOT_FOUND and one_line_error(err), (code, err)
    assert str(path) in err
    assert not (tmp_path / "typo").exists()


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_url_no_backend_serves_is_a_usage_error(name, tmp_path):
    code, err = run(COMMANDS[name], "nosuch://x", tmp_path)
    assert code == EXIT_USAGE and one_line_error(err) and "nosuch" in err, (code, err)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_an_empty_lmdb_data_file_is_a_store_failure_and_stays_empty(name, tmp_path):
    """A zero-length data.mdb is no store: never 'no tags', never initialised by a reader."""
    store = tmp_path / "db"
    store.mkdir()
    (store / "data.mdb").touch()
    code, err = run(COMMANDS[name], f"lmdb://{store}", tmp_path)
    assert code == EXIT_STORE and one_line_error(err), (code, err)
    assert "data.mdb is empty" in err
    assert os.path.getsize(store / "data.mdb") == 0


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A store with one tag, ``v1``: a dense tensor ``w`` and a table ``emb``."""
    url = f"lmdb://{tmp_path_factory.mktemp('saved') / 'db'}"
    t = tensorkv.EmbeddingTable(4)
    t.lookup(np.arange(10))
    tensorkv.save({"w": np.arange(6.0), "emb": t}, url, "v1")
    return url


@pytest.mark.parametrize("name", sorted(TAGGED))
def test_a_tag_that_is_not_there_is_not_found(name, saved, tmp_path):
    code, err = run(TAGGED[name], saved, tmp_path)
    assert code == EXIT_NOT_FOUND and one_line_error(err) and "nope" in err, (code, err)
    assert tensorkv.list_tags(saved) == ["v1"]


def test_the_mapping_follows_the_error_class_wherever_it_is_raised():
    import click

    for exc, code in [(StoreNotFoundError("x"), 3), (TagNotFoundError("x"), 3),
                      (ModelNotFoundError("x"), 3), (ConfigError("x"), 2),
                      (CorruptStoreError("x"), 4), (OSError("x"), 4), (KeyError("x"), 5)]:
        assert exit_code_of(exc) == code, exc
        try:  # a command's refusal raised from it stands for it
            raise click.ClickException(str(exc)) from exc
        except click.ClickException as wrapped:
            assert exit_code_of(wrapped) == code, exc
    assert exit_code_of(click.ClickException("a command's own refusal")) == EXIT_STORE
    assert exit_code_of(click.BadParameter("x")) == EXIT_USAGE
