"""Connectors to outside systems whose client libraries are optional extras.

Each subpackage imports its client library only when a connector is used, so
``import rayflow`` never needs them: ``rayflow.connectors.kafka`` needs the ``kafka``
extra (``pip install 'rayflow[kafka]'``, confluent-kafka).
"""
