def pytest_configure(config):
    config.addinivalue_line(
        "markers", "server: starts a real tritonserver (nvidia-pytriton wheel); slower, needs no GPU"
    )
