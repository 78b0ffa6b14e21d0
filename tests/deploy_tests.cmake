# deploy/: promtool checks and unit tests of the alert rules; the Grafana dashboard and the rules
# against a live lossd_server and a real Prometheus; flags and ports across the Dockerfile, compose
# and Kubernetes files; README's operating section. Included from tests/CMakeLists.txt.
add_test(NAME deploy_files
  COMMAND /usr/bin/python3 -m pytest -q -p no:cacheprovider ${CMAKE_CURRENT_LIST_DIR}/python/test_deploy.py)
set_tests_properties(deploy_files PROPERTIES
  ENVIRONMENT "LOSSD_SERVER_BIN=$<TARGET_FILE:lossd_server>;OMP_NUM_THREADS=2"
  TIMEOUT 1200)
