"""`python -m harness.forkserver FD`: a fork server on the listening unix socket FD (inherited);
its stdin is the lifeline. In each forked child this module goes on to run what was asked for."""

import socket
import sys

from harness.forkserver import child, server

request = server.serve(socket.socket(fileno=int(sys.argv[1])), server.preload())
if request is None:
    sys.exit(0)
child.become(request)
main = request.main
del request
child.run(main)
