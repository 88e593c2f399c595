"""The text an evaluation reads and how it is cut into windows (pure Python: the training script uses it too)."""

from __future__ import annotations

from pathlib import Path

from modelspec.spec import SHIPPED_MODELS, resolve_model_path

HELD_OUT = "held-out"
HELD_OUT_FILE = "held_out.txt"  # beside a shipped model (scripts/train_reference_model.py writes it)


def token_windows(ids: list[int], max_len: int) -> list[list[int]]:
    """Consecutive, non-overlapping windows of at most `max_len` tokens; a last window of one token is dropped.

    Every window token after the first is scored (its log-probability given the window's earlier tokens), so the
    windows together score len(ids) - (number of windows) tokens.
    """
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2 (a window scores its tokens after the first), got {max_len}")
    return [ids[i:i + max_len] for i in range(0, len(ids), max_len) if len(ids[i:i + max_len]) >= 2]


def read_eval_text(model: str, data: str) -> str:
    """The text `--data` names: `held-out` (the held-out split shipped beside a trained model, or a checkpoint
    folder's own held_out.txt) or a UTF-8 text file. ValueError with a one-line reason otherwise."""
    if data == HELD_OUT:
        folder = Path(resolve_model_path(model)).expanduser()
        path = (folder if folder.is_dir() else folder.parent) / HELD_OUT_FILE
        if not path.is_file():
            raise ValueError(f"--data held-out: model {model!r} ships no {HELD_OUT_FILE} (the trained models "
                             f"{', '.join(SHIPPED_MODELS)} do); pass a text file instead")
    else:
        path = Path(data).expanduser()
        if not path.is_file():
            raise ValueError(f"--data {data!r}: no such file (or pass held-out)")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--data {data!r}: cannot read it as UTF-8 text ({type(e).__name__})") from None
    if not text.strip():
        raise ValueError(f"--data {data!r}: the text is empty")
    return text
