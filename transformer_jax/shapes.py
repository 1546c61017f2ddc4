"""The one shape alphabet of the project. Every docstring and shape comment, and the einsum
axes where they are named, use these letters with these meanings and no others.

  B  batch (rows)                     W  beams per sentence
  T  query / target length            S  key / source length (XL: S = M + T)
  M  memory slots (Transformer-XL)    C  decode-cache positions
  O  output positions of a search     R  rows fed to a decode step (B * W)
  P  prompt length                    G  tokens to generate
  N  tokens of a stream               L  layers
  H  heads                            K  head width (D / H)
  D  model width: the stream a model carries between layers (a recurrent model: its state)
  E  embedding width                  A  additive-attention width
  V  vocabulary                       k  convolution kernel size
"""

GLOSSARY = __doc__
