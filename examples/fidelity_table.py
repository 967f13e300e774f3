"""The fidelity table of docs/fidelity.md (issue 12.3): for each model, prefix-cache modes off / naive
/ bicache / fixed:k at several prefix fractions r: accuracy, outputs equal to off, first-step KL and
top-1 agreement at the masked positions, mean depth used, layer-token compute saved, and a plot.
The logic is ``bicache_sgl.bench.fidelity`` (see its docstring and ``--help``).

    python examples/fidelity_table.py --out docs/fidelity_table.json --plot docs/images/fidelity.png
    python examples/fidelity_table.py --model mine=/path/to/model:group:3 --r 0.4,0.8 --fixed 1,2
"""

from bicache_sgl.bench.fidelity import main

if __name__ == "__main__":
    main()
