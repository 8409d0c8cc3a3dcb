"""Generated protobuf and gRPC modules of Evergreen (do not edit: run
``python -m rill.protocols.evergreen.protogen``; a test checks they match the ``.proto`` files)."""
