"""TFDS builder for Multi30k task 1, German-English, raw (cased, untokenized) text.

Each example is one sentence pair {'de': Text, 'en': Text}, stored in the file's line order
(shuffling is disabled, so example i of a split is line i of its files and test outputs can be
written in reference order). Sentences are kept byte-exact, including the few with leading,
trailing or doubled spaces.

Splits (TFDS name: source files): train: train.*, validation: val.*, test_2016_flickr,
test_2017_flickr, test_2017_mscoco, test_2018_flickr.

Written in the `array_record` file format, which needs no TensorFlow; read it back with
`tfds.data_source('multi30k', split=..., data_dir=...)` or `Multi30k(...).as_data_source()`.
"""

from __future__ import annotations

from collections.abc import Mapping

import tensorflow_datasets as tfds
from etils import epath

from train.data.datasets import sources

# Snapshot of multi30k/dataset whose data/task1/raw/*.gz are byte-identical to the shipped files.
_UPSTREAM = (
    "https://raw.githubusercontent.com/multi30k/dataset/"
    "a3d2e0d26b56f3846f66a952536ffed4e401d05a/data/task1/raw/"
)

# TFDS split name -> file stem (line counts: data/multi30k/README.md).
SPLITS = {
    "train": "train",
    "validation": "val",
    "test_2016_flickr": "test_2016_flickr",
    "test_2017_flickr": "test_2017_flickr",
    "test_2017_mscoco": "test_2017_mscoco",
    "test_2018_flickr": "test_2018_flickr",
}
LANGUAGES = ("de", "en")

# SHA-256 of each .gz file (data/multi30k/README.md). Upstream serves the same bytes.
_SHA256 = {
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2017_flickr.de.gz": "a2c89666db00c495cd8513b9d708d5a3acc205d7de312ef2bf5fb7ebc1540aee",
    "test_2017_flickr.en.gz": "76a444ee25172e72695cddb13ae4a3bda59430617be88e0bb46b60504f054074",
    "test_2017_mscoco.de.gz": "799e4854c25d601cb6cb6be29eabe5667734c61ace2f495e03e429031a0bc338",
    "test_2017_mscoco.en.gz": "aab300bfb4427697987e02cd0aacd44bfe8aa50456231b6474c08038bbed2b58",
    "test_2018_flickr.de.gz": "ddd0130c7d97482dc5197a02141dae8dd79f20f03586c480d675c09a32daf608",
    "test_2018_flickr.en.gz": "ef4f4844037d4c5dea75c9a8ed5fd78905967a26f67c255e230cc9780032654d",
}
SOURCE_FILES = tuple(
    sources.SourceFile(
        name=name, sha256=sha, url=_UPSTREAM + name, url_sha256=sha, url_gzipped=True
    )
    for name, sha in _SHA256.items()
)

_CITATION = """\
@inproceedings{elliott-etal-2016-multi30k,
  title = {Multi30K: Multilingual English-German Image Descriptions},
  author = {Elliott, Desmond and Frank, Stella and Sima'an, Khalil and Specia, Lucia},
  booktitle = {Proceedings of the 5th Workshop on Vision and Language},
  year = {2016},
  pages = {70--74},
}
"""


def split_pairs(lines: Mapping[str, list[str]], split: str) -> list[tuple[str, str]]:
    """A split's (de, en) pairs from its files' lines ({file name: lines}), which must pair up."""
    stem = SPLITS[split]
    de, en = lines[f"{stem}.de.gz"], lines[f"{stem}.en.gz"]
    if len(de) != len(en):
        raise sources.DatasetSourceError(
            f"multi30k split {split!r}: {stem}.de.gz has {len(de)} lines but "
            f"{stem}.en.gz has {len(en)}; line i of one must translate line i of the other"
        )
    return list(zip(de, en))


def shipped_pairs(split: str) -> list[tuple[str, str]]:
    """A split read straight from the package's files (checksums verified), no TFDS copy: what
    the prepared dataset holds, in the same order."""
    stem = SPLITS[split]
    files = [f for f in SOURCE_FILES if f.name in (f"{stem}.de.gz", f"{stem}.en.gz")]
    lines = sources.read_sources(files, source=sources.SHIPPED, dataset="multi30k")
    return split_pairs(lines, split)


class Multi30k(sources.SourceBuilder):
    """Multi30k task 1 de-en sentence pairs (raw, cased), in file order."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Raw task1 text of multi30k/dataset, six splits, file order."}

    code_path = epath.Path(__file__)  # see sources.SourceBuilder

    def _info(self) -> tfds.core.DatasetInfo:
        # DatasetInfo directly, not dataset_info_from_configs: that one looks for metadata
        # files (README, CITATIONS.bib) next to the module, which this package does not have.
        return sources.LocalDatasetInfo(
            builder=self,
            description="Multi30k task 1: German-English image descriptions, raw cased text.",
            features=tfds.features.FeaturesDict({lang: tfds.features.Text() for lang in LANGUAGES}),
            supervised_keys=("de", "en"),
            homepage="https://github.com/multi30k/dataset",
            citation=_CITATION,
            # Keep file order: key i is line i (TFDS would otherwise shuffle by key hash).
            disable_shuffling=True,
        )

    def _split_generators(self, dl_manager: tfds.download.DownloadManager):
        # Everything is read and checked before any example is written, so a bad file fails
        # preparation up front and leaves no half-written dataset behind.
        lines = self._read_sources(SOURCE_FILES, dataset="multi30k", dl_manager=dl_manager)
        pairs = {split: split_pairs(lines, split) for split in SPLITS}
        return {split: self._generate_examples(split_pairs) for split, split_pairs in pairs.items()}

    def _generate_examples(self, pairs: list[tuple[str, str]]):
        for i, (de, en) in enumerate(pairs):
            yield i, {"de": de, "en": en}
