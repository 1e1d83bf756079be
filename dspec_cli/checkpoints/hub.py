"""The Hugging Face Hub: checkpoint and target names -> local folders, ``dspec push``, one-line errors.

Every place that accepts a checkpoint or a target calls :func:`resolve_checkpoint`: an existing
local path wins; otherwise the name must be a Hub repo id ``NS/NAME`` (optionally ``@REVISION``)
and is fetched with ``snapshot_download`` into the standard cache (``HF_HOME`` / ``HF_HUB_CACHE``),
from ``HF_ENDPOINT`` (read at call time) or an explicit endpoint. ``HF_HUB_OFFLINE=1`` or an
unreachable Hub falls back to the cache. huggingface_hub retries transient failures a bounded
number of times (5, backing off up to 8 s); requests that carry no timeout of their own get
``DSPEC_HUB_TIMEOUT`` seconds (default 60) instead of waiting forever.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from dspec_cli.core.errors import DspecError
from dspec_cli.core.hub_env import bound_timeouts, hub_endpoint

REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
# what loading needs: configs, weights, tokenizer files, chat templates (not ONNX/GGUF/original/...)
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.tiktoken", "*.jinja"]
AUTH_HINT = "set HF_TOKEN or run `hf auth login`"
E = TypeVar("E", bound=BaseException)


def is_repo_id(name: str) -> bool:
    """``NS/NAME`` with Hub-legal characters."""
    return bool(REPO_ID.match(name))


def split_repo_id(name: str) -> tuple[str, str | None]:
    """``NS/NAME[@REVISION]`` -> (repo id, revision or None); a DspecError for anything else."""
    repo, at, revision = name.partition("@")
    if not is_repo_id(repo) or (at and not revision):
        raise DspecError(f"{name!r} is not a Hub repo id of the form NS/NAME (or NS/NAME@REVISION)")
    return repo, revision or None


def push_repo_id(name: str) -> str:
    """``NS/NAME`` (a revision goes in ``--revision``, not in the id)."""
    repo, revision = split_repo_id(name)
    if revision is not None:
        raise DspecError(f"--repo-id takes NS/NAME; give the branch with --revision, not {name!r}")
    return repo


def resolve_checkpoint(name: str | Path, *, what: str = "checkpoint", endpoint: str | None = None,
                       token: str | None = None) -> Path:
    """A local file or folder as given; else the Hub snapshot of repo ``name`` (see module docstring)."""
    local = Path(name).expanduser()
    if local.exists():
        return local
    try:
        repo, revision = split_repo_id(str(name))
    except DspecError:
        raise DspecError(f"cannot load {what} {str(name)!r}: no such file or folder, "
                         "and not a Hub repo id (NS/NAME)") from None
    from huggingface_hub import snapshot_download

    bound_timeouts()
    endpoint = hub_endpoint(endpoint)
    try:
        folder = Path(snapshot_download(repo, revision=revision, endpoint=endpoint, token=token,
                                        allow_patterns=DOWNLOAD_PATTERNS))
        if (folder / "config.json").is_file() and not any(folder.glob("*.safetensors")):  # .bin-only model
            folder = Path(snapshot_download(repo, revision=revision, endpoint=endpoint, token=token,
                                            allow_patterns=[*DOWNLOAD_PATTERNS, "*.bin"]))
    except Exception as exc:  # noqa: BLE001 - mapped to one line below, or re-raised
        raise hub_error(exc, f"cannot load {what} {str(name)!r}", endpoint) from None
    if not folder.is_dir() or not any(folder.iterdir()):  # an empty repo downloads to no folder at all
        from huggingface_hub import constants

        raise DspecError(f"cannot load {what} {str(name)!r}: the Hub repo {repo} holds no files dspec reads "
                         f"({', '.join(DOWNLOAD_PATTERNS)}) at revision {revision or 'main'} on "
                         f"{endpoint or constants.ENDPOINT}")
    return folder


# -- errors ----------------------------------------------------------------------------------------


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _first_line(text: object) -> str:
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    return lines[0] if lines else ""


def hub_error(exc: BaseException, action: str, endpoint: str | None, *, push: bool = False) -> BaseException:
    """A one-line DspecError for a Hub failure anywhere in ``exc``'s chain (else ``exc`` itself)."""
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = endpoint or constants.ENDPOINT
    chain = list(_chain(exc))

    def found(kind: type[E]) -> E | None:
        return next((e for e in chain if isinstance(e, kind)), None)

    transport = next((e for e in chain if any(c.__name__ == "TransportError" for c in type(e).__mro__)), None)
    if isinstance(exc, ValueError) and "README.md" in str(exc):  # from /api/validate-yaml
        return DspecError(f"{action}: the Hub rejected README.md's metadata ({' '.join(str(exc).split())})")
    if found(GatedRepoError):
        return DspecError(f"{action}: the repo is gated on {where}; accept its terms there and {AUTH_HINT}")
    if found(RepositoryNotFoundError):
        return DspecError(f"{action}: repo not found on {where} (a private repo needs a token: {AUTH_HINT})")
    if found(RevisionNotFoundError):
        return DspecError(f"{action}: revision not found on {where}")
    http = found(HfHubHTTPError)
    if http is not None and http.response is not None:
        code = http.response.status_code
        detail = _first_line(http.server_message or http.response.reason_phrase)
        if code in (401, 403):
            return DspecError(f"{action}: {where} refused the request (HTTP {code}: {detail}); {AUTH_HINT} "
                              "with a token that has access")
        retry = "nothing was committed, run the command again to retry" if push else "try again later"
        return DspecError(f"{action}: {where} answered HTTP {code} ({detail}); {retry}")
    if transport is not None:
        cached = " and it is not in the local cache" if found(LocalEntryNotFoundError) else ""
        return DspecError(f"{action}: cannot reach {where} ({type(transport).__name__}: {_first_line(transport)})"
                          f"{cached}; check --endpoint / HF_ENDPOINT and the network")
    if found(OfflineModeIsEnabled):
        return DspecError(f"{action}: HF_HUB_OFFLINE is set and it is not in the local cache")
    if found(LocalEntryNotFoundError):
        return DspecError(f"{action}: not in the local cache and {where} could not be used "
                          f"({_first_line(found(LocalEntryNotFoundError))})")
    return exc


# -- push ------------------------------------------------------------------------------------------


@dataclass
class PushResult:
    repo_id: str
    revision: str
    url: str  # the repo (or branch) page
    commit_url: str
    commit: str
    files: list[str]


def push_folder(folder: Path, repo_id: str, files: list[str], card: str, *, message: str, private: bool = False,
                revision: str | None = None, endpoint: str | None = None, token: str | None = None,
                on_file: Callable[[str, int], None] | None = None) -> PushResult:
    """Upload ``files`` of ``folder`` and the model card ``card`` (as README.md) in one commit.

    Creates the repo (and the branch ``revision``) if missing; LFS blobs are uploaded first
    (``on_file(name, bytes)`` after each), then one commit, so a failure commits nothing.
    """
    from huggingface_hub import CommitOperationAdd, HfApi

    repo = push_repo_id(repo_id)
    bound_timeouts()
    endpoint = hub_endpoint(endpoint)
    api = HfApi(endpoint=endpoint, token=token or None)
    ops = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in files]
    ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()))
    try:
        api.create_repo(repo, private=private, exist_ok=True)
        if revision and revision != "main":
            api.create_branch(repo, branch=revision, exist_ok=True)
        for op in ops:
            api.preupload_lfs_files(repo, [op], revision=revision, free_memory=False)
            if on_file is not None:
                on_file(op.path_in_repo, op.upload_info.size)
        info = api.create_commit(repo, operations=ops, commit_message=message, revision=revision)
    except Exception as exc:  # noqa: BLE001 - mapped to one line, or re-raised
        raise hub_error(exc, f"cannot push to {repo}", endpoint, push=True) from None
    url = f"{api.endpoint}/{repo}" + (f"/tree/{revision}" if revision and revision != "main" else "")
    return PushResult(repo, revision or "main", url, info.commit_url, info.oid, [op.path_in_repo for op in ops])
