"""Any prepared TFDS dataset as training data: `--dataset tfds:NAME[/CONFIG][:VERSION]`.

The dataset is read from the run's data_dir through TFDS's data source API (random access to
array_record files), which needs no TensorFlow: a translation dataset's examples are dicts
keyed by language code ('wmt14_translate/de-en': {'de': ..., 'en': ...}), a text dataset's
have a text feature ('lm1b': {'text': ...}).

Splits: 'train' is trained on; validation is the dataset's 'validation' (or 'valid', 'dev'),
else the last 1% of 'train' held out (lm1b has only train and test); 'test', when there is
one, is the test set, named '<NAME>.test'.

Nothing is downloaded here. A dataset not prepared in the data dir is a DataError giving the
command that prepares it (this module's `python -m train.data.tfds_source NAME --data_dir D`:
TFDS's builder in the array_record format), as are an unknown name, a feature the dataset
lacks, a missing 'train' split and unreadable records; all before any training.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import importlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from train.data.text_files import DataError, error_cause

PREFIX = "tfds:"
VALIDATION_SPLITS = ("validation", "valid", "dev")
HELD_OUT = 0.01  # of 'train', the validation set of a dataset without one
# TFDS's builders of text datasets that only register when their collection is imported (the
# newer ones, such as lm1b, are found by name without it).
_COLLECTIONS = ("translate", "text", "summarization", "question_answering", "text_simplification")
_CHUNK = 4096  # examples per batched read


def is_tfds(dataset: str) -> bool:
    return dataset.startswith(PREFIX)


def tfds_name(dataset: str) -> str:
    """'tfds:NAME[/CONFIG][:VERSION]' -> 'NAME[/CONFIG][:VERSION]' (ValueError naming the
    field when nothing or whitespace follows the prefix; TFDS parses the rest)."""
    name = dataset.removeprefix(PREFIX)
    if not is_tfds(dataset) or not name or any(c.isspace() for c in name):
        raise ValueError(
            f"dataset: expected tfds:NAME[/CONFIG] (e.g. tfds:wmt14_translate/de-en), "
            f"got {dataset!r}"
        )
    return name


def prepare_command(name: str, data_dir: str | os.PathLike | None) -> str:
    where = f" --data_dir {os.fspath(data_dir)}" if data_dir is not None else ""
    return f"python -m train.data.tfds_source {name}{where}"


@dataclasses.dataclass(frozen=True)
class Splits:
    """The TFDS split names one run reads (slices such as 'train[:990]' included)."""

    train: str
    validation: str
    test: str | None
    note: str = ""  # how the splits were found, for the log, when not as named


class TfdsDataset:
    """A prepared TFDS dataset, opened for reading: `open_dataset` makes one."""

    def __init__(self, dataset: str, builder: Any):
        self.dataset, self.builder = dataset, builder

    @property
    def name(self) -> str:
        return self.builder.name

    @property
    def info_path(self) -> str:
        """The prepared copy's dataset_info.json (its version, splits and sizes)."""
        return os.path.join(os.fspath(self.builder.data_dir), "dataset_info.json")

    def splits(self) -> Splits:
        available = list(self.builder.info.splits.keys())
        if "train" not in available:
            raise DataError(
                f"{self.dataset}: no 'train' split to train on (its splits: "
                f"{', '.join(sorted(available))})"
            )
        test = "test" if "test" in available else None
        for name in VALIDATION_SPLITS:
            if name in available:
                return Splits("train", name, test)
        n = self.builder.info.splits["train"].num_examples
        held = max(1, round(n * HELD_OUT))
        if n - held < 1:
            raise DataError(
                f"{self.dataset}: no validation split, and its 'train' split has {n} "
                "example(s), too few to hold some out"
            )
        return Splits(
            f"train[:{n - held}]",
            f"train[{n - held}:]",
            test,
            note=f"no validation split: validation is the last {held:,} of its {n:,} "
            "training examples, held out of training",
        )

    def features(self) -> list[str]:
        return sorted(self.builder.info.features.keys())

    def check_text_features(self, names: Sequence[str], *, field: str, what: str) -> None:
        """Each of `names` must be a text feature of the examples (DataError naming `field`
        and listing the dataset's `what` values otherwise)."""
        import tensorflow_datasets as tfds  # lazy: importing TFDS is not free

        features = self.builder.info.features
        for name in names:
            if name not in features.keys() or not isinstance(features[name], tfds.features.Text):
                texts = [k for k in features.keys() if isinstance(features[k], tfds.features.Text)]
                raise DataError(
                    f"{field}: {self.dataset} has no {what} {name!r} (its {what}s: "
                    f"{', '.join(sorted(texts)) or 'none'})"
                )

    def read(self, split: str, names: Sequence[str]) -> list[tuple[str, ...]]:
        """The text features `names` of every example of `split`, in the prepared order, as a
        list: for small splits (validation, test); `iter_read` streams a large one."""
        return list(self.iter_read(split, names))

    def iter_read(
        self, split: str, names: Sequence[str], *, batch: int = _CHUNK
    ) -> Iterator[tuple[str, ...]]:
        """The text features `names` of every example of `split`, in the prepared order, one
        tuple at a time: `batch` examples are read per call to the data source, so a split
        of any size is never held whole. The split is opened when the stream starts."""
        try:
            source = self.builder.as_data_source(split=split)
        except Exception as e:  # TFDS raises many types for a missing or damaged file
            raise DataError(
                f"{self.dataset}: split {split!r} in {self.builder.data_dir} cannot be "
                f"opened ({error_cause(e)})"
            ) from e
        for start in range(0, len(source), batch):
            keys = list(range(start, min(start + batch, len(source))))
            try:
                examples = source.__getitems__(keys)
            except Exception as e:  # array_record raises many types for a damaged file
                raise DataError(
                    f"{self.dataset}: split {split!r} in {self.builder.data_dir} cannot be "
                    f"read ({error_cause(e)}); prepare it again"
                ) from e
            for index, example in zip(keys, examples):
                yield tuple(_text(example[n], self.dataset, split, index) for n in names)


def _text(value: Any, dataset: str, split: str, index: int) -> str:
    if isinstance(value, str):
        return value
    try:
        return bytes(value).decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(
            f"{dataset}: split {split!r}, example {index}: not UTF-8 ({e.reason} at byte {e.start})"
        ) from None


def _root(data_dir: str | os.PathLike | None) -> str:
    import tensorflow_datasets as tfds  # lazy: importing TFDS is not free

    return os.fspath(data_dir) if data_dir is not None else tfds.core.constants.DATA_DIR


@contextlib.contextmanager
def without_bucket_metadata():
    """TFDS's builders made inside skip TFDS's look for a dataset's pre-computed metadata on its
    bucket. TFDS looks whenever a builder is made over a directory without a prepared copy, and
    each look leaves an empty temporary folder behind: it makes the folder first, then finds
    its bucket switched off (as TFDS's releases ship it). Nothing here reads that metadata: a
    prepared copy carries its own, and preparing computes it. (The package's own builders skip
    the look through their DatasetInfo: train.data.datasets.sources.)"""
    import tensorflow_datasets as tfds  # lazy: importing TFDS is not free

    info = tfds.core.DatasetInfo
    look = info.initialize_from_bucket
    info.initialize_from_bucket = lambda self: None
    try:
        yield
    finally:
        info.initialize_from_bucket = look


def _builder(name: str, data_dir: str | os.PathLike | None, **kwargs):
    """TFDS's builder of `name` (prepared or not); DataError for an unknown name or config."""
    import tensorflow_datasets as tfds  # lazy: importing TFDS is not free

    for collection in _COLLECTIONS:
        try:
            importlib.import_module(f"tensorflow_datasets.{collection}")
        except ImportError:  # a collection whose own imports are missing here
            pass
    try:
        with without_bucket_metadata():
            return tfds.builder(name, data_dir=data_dir, **kwargs)
    except tfds.core.registered.DatasetNotFoundError:
        known = sorted(set(tfds.list_builders(with_community_datasets=False)))
        close = difflib.get_close_matches(name.split("/")[0].split(":")[0], known, n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise DataError(
            f"tfds:{name}: TFDS has no dataset of that name, and none is prepared in "
            f"{_root(data_dir)}{hint}"
        ) from None
    except (ValueError, AssertionError) as e:  # a bad config, version or name syntax
        raise DataError(f"tfds:{name}: {error_cause(e)}") from e


def open_dataset(dataset: str, data_dir: str | os.PathLike | None) -> TfdsDataset:
    """The prepared TFDS dataset `dataset` ('tfds:...') in `data_dir` (None: TFDS's default,
    $TFDS_DATA_DIR or ~/tensorflow_datasets), readable without TensorFlow."""
    name = tfds_name(dataset)
    builder, root = _builder(name, data_dir), _root(data_dir)
    if not builder.is_prepared():
        raise DataError(
            f"{dataset} is not prepared in {root}; prepare it once (it downloads the data): "
            f"{prepare_command(name, root)}"
        )
    if "array_record" not in {f.value for f in builder.info.available_file_formats()}:
        raise DataError(
            f"{dataset} in {root} is prepared as {builder.info.file_format.value}, which only "
            f"TensorFlow reads; prepare it as array_record in another data dir: "
            f"{prepare_command(name, '<another dir>')}"
        )
    return TfdsDataset(dataset, builder)


def prepare(name: str, data_dir: str | os.PathLike | None) -> str:
    """Downloads and prepares TFDS's dataset `name` in the array_record format -> where."""
    import tensorflow_datasets as tfds  # lazy: importing TFDS is not free

    builder = _builder(name, data_dir, file_format="array_record")
    try:
        # Not TFDS's prepared copies on GCS: they are TFRecord files, which need TensorFlow.
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(try_download_gcs=False)
        )
    except ModuleNotFoundError as e:
        # TFDS's builders run their own code to prepare; some of it (lm1b's file listing,
        # the older builders' code paths) imports what reading never needs.
        raise DataError(
            f"preparing {name} runs TFDS's builder code, which needs the Python module "
            f"{e.name!r} (pip install {e.name}, for the preparation only: reading the "
            "prepared dataset does not need it)"
        ) from e
    return os.fspath(builder.data_dir)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m train.data.tfds_source",
        description="Download and prepare a TFDS dataset (array_record) for --dataset tfds:NAME.",
    )
    parser.add_argument("name", help="NAME[/CONFIG][:VERSION], e.g. wmt14_translate/de-en")
    parser.add_argument(
        "--data_dir", default=None, help="default: $TFDS_DATA_DIR or ~/tensorflow_datasets"
    )
    args = parser.parse_args(argv)
    try:
        print(f"prepared: {prepare(args.name, args.data_dir)}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
