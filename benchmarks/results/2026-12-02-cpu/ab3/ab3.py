import sys, time, torch
from qsv_pyg.nn import QSVConv
from qsv_pyg.geometry import fibonacci_sphere, knn_within
torch.manual_seed(0)
out=[]
for n in (4096, 16384):
    pos=fibonacci_sphere(n); ei=knn_within(pos, k=16)
    conv=QSVConv(64,16,heads=4,check_finite=False)
    x=torch.randn(n,64,requires_grad=True)
    for _ in range(3): conv(x,ei).sum().backward()
    ts=[]
    for _ in range(15):
        t=time.perf_counter(); conv(x,ei).sum().backward(); ts.append(time.perf_counter()-t)
    ts.sort(); out.append(f"{1000*ts[7]:.2f}")
print(sys.argv[1], *out)
