#!/bin/bash
# The docs build of .ci/run, twice, one after another on the idle machine: "serial" is a fresh
# clone of HEAD as committed (before docs/_ext/parallel_notebooks.py), "parallel" the same
# clone with the working tree's docs/conf.py and the extension. Run from the repository with
# the extension uncommitted; the times go to docs_ab.out.
REPO=$(git rev-parse --show-toplevel)
. "$REPO"/.venv/bin/activate
for arm in serial parallel; do
  d=$(mktemp -d); git clone -q "$REPO" $d/main
  if [ $arm = parallel ]; then cp "$REPO"/docs/conf.py $d/main/docs/; cp "$REPO"/docs/_ext/parallel_notebooks.py $d/main/docs/_ext/; fi
  cd $d/main; s=$(date +%s.%N)
  PYTHONPATH=$d/main sphinx-build -j auto -W --keep-going -q -b html docs docs/_build/html > $d/build.log 2>&1
  rc=$?; e=$(date +%s.%N)
  echo "$arm rc=$rc seconds=$(python3 -c "print(round($e-$s,1))") dir=$d" >> "$REPO/docs_ab.out"
  cd "$REPO"
done
echo done >> "$REPO/docs_ab.out"
