import json, time, torch, random
torch.set_num_threads(1); torch.manual_seed(0)
from pathlib import Path
from PIL import Image
from lmforge.config.schema import TokenizerTrainConfig
from lmforge.data.shapes import write_shapes_task
from lmforge.data.tokenizer import train_tokenizer
from lmforge.models.vision import build_vision_model
t0=time.time()
task=write_shapes_task(Path("/tmp/vlm/task"), train_rows=600, eval_rows=100)
def rows(p): return [json.loads(l) for l in p.read_text().splitlines()]
tr, ev = rows(task.train), rows(task.eval)
texts=[t["value"] for r in tr for t in r["conversations"]]*5
tok=train_tokenizer(texts, TokenizerTrainConfig(vocab_size=300, min_frequency=1))
model, proc = build_vision_model("smolvlm-tiny", tok)
print("params", sum(p.numel() for p in model.parameters()))
def enc(r, with_answer=True):
    q=r["conversations"][0]["value"]; a=r["conversations"][1]["value"]
    img=Image.open(task.train.parent/r["images"][0]).convert("RGB")
    return q+" =", " "+a+tok.eos_token, img
def batch(rs):
    prompts, answers, imgs = zip(*[enc(r) for r in rs])
    full=[p+a for p,a in zip(prompts,answers)]
    b=proc(text=list(full), images=[[i] for i in imgs], return_tensors="pt", padding=True)
    lab=b["input_ids"].clone(); lab[b["attention_mask"]==0]=-100
    for i,(p) in enumerate(prompts):
        n=len(proc(text=[p], images=[[imgs[i]]])["input_ids"][0])
        # left or right padding? assume right
        lab[i,:n]=-100
    return b, lab
opt=torch.optim.AdamW(model.parameters(), lr=1e-3)
def acc():
    model.eval(); ok=0
    with torch.no_grad():
        for r in ev:
            p,a,img=enc(r)
            b=proc(text=[p], images=[[img]], return_tensors="pt")
            out=model.generate(**b, max_new_tokens=4, do_sample=False)
            ans=tok.decode(out[0, b["input_ids"].shape[1]:], skip_special_tokens=True).strip()
            ok+= ans.split(" ")[0]==r["conversations"][1]["value"]
    model.train(); return ok/len(ev)
print("acc0", acc(), tok.padding_side)
for step in range(900):
    rs=random.Random(step).sample(tr, 16)
    b,lab=batch(rs)
    loss=model(**b, labels=lab).loss
    loss.backward(); opt.step(); opt.zero_grad()
    if step%150==149: print(step, float(loss), "acc", acc(), round(time.time()-t0))
b,lab=batch(tr[:1]); print([ (tok.convert_ids_to_tokens(int(i)), int(l)) for i,l in zip(b["input_ids"][0], lab[0]) if l!=-100])
