"""Generated gRPC stubs of proto/lossd/v1/lossd.proto (lossd_pb2.py, lossd_pb2_grpc.py).

They are build outputs, never committed: CMake's lossd_python target generates them into
${CMAKE_BINARY_DIR}/python/lossd/v1, and `pip install ./client/python` into the installed package.
"""
