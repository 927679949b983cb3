"""Control plane: gRPC scheduler on the parameter-server host, worker client, assignment protocol."""
