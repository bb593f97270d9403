"""A fork server: many short `harness` processes without each importing torch (some 6
CPU-seconds a process): a server process imports torch and the harness once, runs no torch
operation, and forks a child per command line that then runs `python -m harness.cli ARGS` (or
torchrun's launcher, `python -m torch.distributed.run ARGS`, or a script, `python SCRIPT ARGS`) as a
fresh interpreter would, with its own argv, environment, working folder, stdio and session.

The children are real processes (pids, signals, exit codes, process groups as any Popen child's:
the server shares its starter's group), children of the server. Modules:
  inherited_env.py  the variables read before a child's first line: a child must match its server there
  protocol.py     the messages between client and server (JSON, fds over a unix socket)
  relay.py        the process a launcher starts that has a server fork the real one and stands in for it
  server.py       the server process: preload, serve, fork, reap
  child.py        the forked child made into a fresh `python -m MODULE` process
  client.py       ForkServer (one server process), NamedServer (one another process started) and
                  ForkedPopen (a Popen of one of a server's children)
  pool.py         ForkServers: a server per environment signature, for a test session or a command;
                  popen_for: a pool's popen where the environment lets it serve (verify-resume)
This face imports none of them: the CLI imports relay.py for every command, which must stay light.
"""
