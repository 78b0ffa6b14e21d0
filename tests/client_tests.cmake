# The C++ client library and lossctl (client/cpp), against real servers on loopback.
add_executable(client_test
  ${CMAKE_CURRENT_LIST_DIR}/client_test.cc
  ${CMAKE_CURRENT_LIST_DIR}/holding_relay.cc
)
target_link_libraries(client_test PRIVATE
  lossd_test_server_harness
  lossd_client
  lossd_npy
  GTest::gtest_main
)
gtest_discover_tests(client_test DISCOVERY_TIMEOUT 300)

# Scoring over replicas of one head: several real servers in one process, one target.
add_executable(replicas_test
  ${CMAKE_CURRENT_LIST_DIR}/replicas_test.cc
)
target_link_libraries(replicas_test PRIVATE
  lossd_test_server_harness
  lossd_client
  OpenSSL::Crypto
  GTest::gtest_main
)
gtest_discover_tests(replicas_test DISCOVERY_TIMEOUT 300)

# lossctl run as a user would, against the real lossd_server binary.
add_test(NAME lossctl_test
  COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${CMAKE_CURRENT_LIST_DIR}/lossctl_test.py)
set_tests_properties(lossctl_test PROPERTIES
  ENVIRONMENT "LOSSD_SERVER_BIN=$<TARGET_FILE:lossd_server>;LOSSCTL_BIN=$<TARGET_FILE:lossctl>;OMP_NUM_THREADS=2"
  TIMEOUT 600)
