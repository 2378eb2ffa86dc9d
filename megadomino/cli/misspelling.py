"""Which known flag an unknown one most likely misspells (the hint of an unknown flag's error)."""

from __future__ import annotations


def closest_flag(name: str, known: list[str]) -> str | None:
    """The flag of `known` that an unknown `name` most likely misspells, or None.

    Three slips are hinted: another spelling of the same words (case, `_` for `-`), a word cut
    short (`--num-layer` for `--num-layers`; abbreviations are not expanded), and one typing slip
    inside a word of at least four letters: a letter dropped, doubled, swapped with its
    neighbour or mistyped past the word's first letter (`--micro-batch-szie`,
    `--tensor-model-paralel-size`), when exactly one flag is that close. Digits, first letters
    and whole words are never guessed: Megatron-LM has flags one such character or word apart
    (`--adam-beta1` / `--adam-beta2`, `--save-dgrads-interval` / `--save-wgrads-interval`),
    and a hint naming another real flag is worse than none.
    """
    spelled = {flag.lower().replace("_", "-"): flag for flag in known}
    key = name.lower().replace("_", "-")
    if key in spelled:
        return spelled[key]
    longer = [flag for spelling, flag in spelled.items()
              if spelling.startswith(key) and "-" not in spelling[len(key):]]
    if len(longer) == 1:
        return longer[0]
    slipped = [flag for spelling, flag in spelled.items() if _one_slip(key, spelling)]
    return slipped[0] if len(slipped) == 1 else None


def _one_slip(typed: str, flag: str) -> bool:
    """`typed` is `flag` with one letter dropped, added, replaced (not the first) or swapped with
    its neighbour, inside one word of at least four letters of it, every other word the same."""
    typed_words, flag_words = typed.split("-"), flag.split("-")
    if len(typed_words) != len(flag_words):
        return False
    differ = [(a, b) for a, b in zip(typed_words, flag_words) if a != b]
    if len(differ) != 1:
        return False
    a, b = differ[0]
    if len(b) < 4 or not (a.isalpha() and b.isalpha()):
        return False
    if len(a) == len(b):
        wrong = [i for i in range(len(a)) if a[i] != b[i]]
        return (len(wrong) == 1 and wrong[0] > 0) or (len(wrong) == 2 and wrong[1] == wrong[0] + 1
                                   and a[wrong[0]] == b[wrong[1]] and a[wrong[1]] == b[wrong[0]])
    short, long_ = (a, b) if len(a) < len(b) else (b, a)
    return len(long_) == len(short) + 1 and any(long_[:i] + long_[i + 1:] == short
                                                for i in range(len(long_)))
