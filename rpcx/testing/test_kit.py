"""The conformance kit, whole: every test rpcx's built-in backends pass, in one module.

Run it on any backend, from the installed package::

    pytest -p rpcx.testing.fixtures --pyargs rpcx.testing --rpcx-backend=NAME

``--pyargs rpcx.testing`` collects this module and only this one (the others are not
named ``test_*``), so the suite cannot be run in part by accident. Tests a backend cannot
take skip with the reason: those marked ``rpcx_requires`` when its
:class:`~rpcx.transport.Capabilities` lack a flag, the CUDA ones without a GPU.
"""

from rpcx.testing.conformance import *  # noqa: F403
from rpcx.testing.conformance_auth import *  # noqa: F403
from rpcx.testing.conformance_certificates import *  # noqa: F403
from rpcx.testing.conformance_cipher import *  # noqa: F403
from rpcx.testing.conformance_cuda import *  # noqa: F403
from rpcx.testing.conformance_dynamic import *  # noqa: F403
from rpcx.testing.conformance_dynamic_keyed import *  # noqa: F403
from rpcx.testing.conformance_failures import *  # noqa: F403
from rpcx.testing.conformance_hostile import *  # noqa: F403
from rpcx.testing.conformance_hosts import *  # noqa: F403
from rpcx.testing.conformance_links import *  # noqa: F403
from rpcx.testing.conformance_parity import *  # noqa: F403
from rpcx.testing.conformance_store_seals import *  # noqa: F403
