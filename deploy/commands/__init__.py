"""The ``kvroute`` subcommands, one module each (``deploy.cli`` registers them): ``serve``,
``loadgen``, ``profile``, ``simulate``, ``plan`` and ``cachesim``. A command reads its flags and
calls what the packages below hold; the workload flags that ``loadgen``, ``simulate`` and
``plan`` share are ``loadgen.args``', and those ``simulate`` and ``plan`` share
``simulation.options``'."""
