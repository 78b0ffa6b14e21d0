# Safetensors reading/writing, checkpoints and Hugging Face model checkpoints (storage/).
add_executable(storage_test
  checkpoint_test.cc
  hf_checkpoint_test.cc
  safetensors_test.cc
)
target_link_libraries(storage_test PRIVATE lossd_storage GTest::gtest_main)
gtest_discover_tests(storage_test DISCOVERY_TIMEOUT 300)
