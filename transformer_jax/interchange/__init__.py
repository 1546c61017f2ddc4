"""Models in and out of other systems' formats: OPUS-MT (Marian) checkpoints in the Hugging Face
layout, read (`marian`, its tokenizer in `marian_tokenizer`) and written (`marian_export`), and
CTranslate2's for serving (`ct2`)."""
