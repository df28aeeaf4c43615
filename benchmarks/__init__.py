"""The evaluation and benchmarks of mlxevict (installed as ``mlxevict.benchmarks``).

``mlxevict eval MODEL`` measures quality per budget (:mod:`.quality`) on seeded
tasks (:mod:`.tasks`); ``mlxevict bench MODEL`` measures speed and memory
(:mod:`.speed`); :mod:`.report` writes JSON, Markdown and PNG; :mod:`.cli` adds
both commands. The library never imports this package.
"""
