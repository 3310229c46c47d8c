# Sourced by gpu_check.sh and gpu_calibrate.sh: the Python that runs fusesearch on a GPU machine.
# The interpreter is the machine's own `python3` (the one that holds CuPy), used as it is: a venv
# made from it would lose its packages when it is itself a venv. Packages missing there travel as
# wheels in .whl/ and are installed into .gpusite/, which comes first on PYTHONPATH with the
# checkout itself (so `python -m fusesearch` is this tree's code, nothing installed into the image).
PY=${PY:-python3}
if compgen -G ".whl/*.whl" > /dev/null; then
  $PY -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade --target .gpusite .whl/*.whl
fi
export PYTHONPATH="$PWD:$PWD/.gpusite${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
