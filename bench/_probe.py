import time, torch
from blockspec.kernels.rms_norm import _rms_norm_kernel
torch.set_grad_enabled(False)
x = torch.randn(200, 4096, device="cuda", dtype=torch.bfloat16); w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
y = torch.empty_like(x)
def loop(fn, n=300):
    fn(); torch.cuda.synchronize(); t0=time.perf_counter()
    for _ in range(n): fn()
    t1=time.perf_counter(); torch.cuda.synchronize(); return round((t1-t0)/n*1e6, 2)
ck = _rms_norm_kernel[(200,)](x, x, w, y, y, 4096, 1e-6, HAS_RES=False, BLOCK=4096, num_warps=4)
print("jit launch", loop(lambda: _rms_norm_kernel[(200,)](x, x, w, y, y, 4096, 1e-6, HAS_RES=False, BLOCK=4096, num_warps=4)))
from triton.runtime import driver
dev = driver.active.get_current_device()
stream = driver.active.get_current_stream(dev)
args = (x, x, w, y, y, 4096, 1e-6, False, 4096)
def direct():
    ck.run(200, 1, 1, stream, ck.function, ck.packed_metadata, None, None, None, *args)
print("compiled run (fixed stream)", loop(direct))
def direct2():
    s = torch.cuda.current_stream().cuda_stream
    ck.run(200, 1, 1, s, ck.function, ck.packed_metadata, None, None, None, *args)
print("compiled run + current_stream", loop(direct2))
def direct3():
    s = driver.active.get_current_stream(driver.active.get_current_device())
    ck.run(200, 1, 1, s, ck.function, ck.packed_metadata, None, None, None, x, x, w, y, y, 4096, 1e-6, False, 4096)
print("compiled run + triton stream query", loop(direct3))
print("torch add", loop(lambda: torch.add(x, x)))
print("torch.empty_like", loop(lambda: torch.empty_like(x)))
torch.testing.assert_close(y, torch.nn.functional.rms_norm(x.float(), (4096,), w.float(), 1e-6).to(y.dtype), rtol=2e-2, atol=2e-2)
print("ok")
