import torch, math, time
from qsv_pyg.nn.models import QSVGeometric
from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion
def rot(seed):
    q = random_unit_quaternion(generator=torch.Generator().manual_seed(seed)).double()
    return quaternion_to_matrix(q/q.norm())
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
clouds = [torch.randn(128,3,generator=g,dtype=torch.float64)*torch.tensor([1,.6,.3],dtype=torch.float64) for _ in range(3)]
plate = torch.rand(128,3,generator=g,dtype=torch.float64)*2-1; plate[:,2]=0
ang = torch.arange(24,dtype=torch.float64)*2*math.pi/24
poly = torch.stack([ang.cos(),ang.sin(),0*ang],1).repeat(1,1)
clouds += [plate]
for hier in (None, True):
    m = QSVGeometric(10, hidden_channels=32, heads=2, k=12, pair_features=True, edge_message=True, source_logit=True, hierarchy=hier).double().eval()
    pos = torch.cat(clouds); batch = torch.arange(len(clouds)).repeat_interleave(128)
    t0=time.time(); a = m(pos, batch); t1=time.time()
    pr = torch.cat([c @ rot(i+5).T + torch.randn(3,generator=g,dtype=torch.float64)*3 for i,c in enumerate(clouds)])
    b = m(pr, batch)
    print(hier, a.shape, (a-b).abs().max().item(), f"{t1-t0:.2f}s")
    m2 = QSVGeometric(10, hidden_channels=32, heads=2, k=2, pair_features=False, num_layers=2).double().eval()
    print("poly", (m2(poly) - m2(poly @ rot(3).T + 1.0)).abs().max().item())
