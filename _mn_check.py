import numpy as np, torch, time
from qsv_pyg.geometry import oriented_frames, knn_within
from qsv_pyg.quaternion import quaternion_to_matrix, random_unit_quaternion
torch.set_num_threads(1)
f = np.load('/work/shared/data/ModelNet10/modelnet10_pcd1024.npz')
P = torch.from_numpy(f['pos_test'][::18][:51, :512].astype(np.float64))
P = P - P.mean(1, keepdim=True); P = P / P.norm(dim=2).amax(1)[:, None, None]
g = torch.Generator().manual_seed(0)
for dt in (torch.float64, torch.float32):
  for rule in ("robust", "pca+centroid", "pca"):
    tot = ch = amb = 0; worst = 0
    for i, p in enumerate(P):
        q = random_unit_quaternion(generator=g).double(); G = quaternion_to_matrix(q/q.norm())
        a_pos = p.to(dt); b_pos = (p @ G.T).to(dt)
        ea, eb = knn_within(a_pos.double(), 16), knn_within(b_pos.double(), 16)
        a = oriented_frames(a_pos, ea, rule=rule); b = oriented_frames(b_pos, eb, rule=rule)
        ok = ~a.ambiguous & ~b.ambiguous
        c = ((b.frame - G @ a.frame).abs().amax((1,2)) > 1e-3) & ok
        same_graph = (ea[0].view(-1,16).sort(1).values == eb[0].view(-1,16).sort(1).values).all(1)
        c = c & same_graph
        tot += len(p); ch += int(c.sum()); amb += int((a.ambiguous | b.ambiguous).sum())
        worst = max(worst, float(c.float().mean()))
    print(dt, rule, f"changed {ch}/{tot} = {100*ch/tot:.2f}% (worst shape {100*worst:.1f}%), ambiguous {amb}")
