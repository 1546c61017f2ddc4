// Opens every page of a built site at 1280 px with the network blocked; prints what it finds.
import chromium from "@sparticuz/chromium";
import puppeteer from "puppeteer-core";
import fs from "fs";
import path from "path";
const root = path.resolve(process.argv[2]);
const pages = [];
(function walk(d) { for (const f of fs.readdirSync(d)) { const p = path.join(d, f);
  if (fs.statSync(p).isDirectory()) { if (!["_static", "_sources", "_images", "_modules"].includes(f)) walk(p); }
  else if (p.endsWith(".html") && !["genindex.html", "search.html", "py-modindex.html"].includes(f)) pages.push(p); } })(root);
const browser = await puppeteer.launch({ executablePath: await chromium.executablePath(), args: [...chromium.args, "--no-sandbox"], headless: true });
const report = {};
for (const file of pages.sort()) {
  const page = await browser.newPage();
  await page.setViewport({ width: 1280, height: 900 });
  await page.setRequestInterception(true);
  const blocked = [], errors = [];
  page.on("request", r => { if (r.url().startsWith("file:") || r.url().startsWith("data:")) r.continue(); else { blocked.push(r.url()); r.abort(); } });
  page.on("pageerror", e => errors.push(String(e)));
  page.on("console", m => { if (m.type() === "error") errors.push(m.text()); });
  await page.goto("file://" + file, { waitUntil: "load" });
  await new Promise(r => setTimeout(r, 300));
  const found = await page.evaluate(() => {
    const out = { h1_midword: [], wide_pre: 0, pre_total: 0, wide_math: 0, bad_alt: [], broken_img: 0 };
    for (const h of document.querySelectorAll("h1")) {
      const text = h.textContent.replace("#", "").trim();
      const range = document.createRange(); range.selectNodeContents(h);
      const lines = new Set([...range.getClientRects()].map(r => Math.round(r.top)));
      // a title on more lines than its words need: a break inside a word
      const words = text.split(/\s+/);
      if (lines.size > 1) {
        for (const node of [...h.childNodes].flatMap(n => n.nodeType === 3 ? [n] : [...n.querySelectorAll ? [n] : []])) {}
        const walker = document.createTreeWalker(h, NodeFilter.SHOW_TEXT);
        let n; while ((n = walker.nextNode())) {
          const re = /[^\s\u200b]+/g; let m;
          while ((m = re.exec(n.data))) {
            const r = document.createRange(); r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
            const tops = new Set([...r.getClientRects()].map(x => Math.round(x.top)));
            if (tops.size > 1) out.h1_midword.push(m[0]);
          }
        }
      }
    }
    out.wide_list = [];
    for (const p of document.querySelectorAll("pre")) { out.pre_total++; if (p.scrollWidth > p.clientWidth + 1) { out.wide_pre++;
      const kind = p.closest(".cell_output") ? "output" : (p.closest(".cell_input") ? "input" : "block");
      const longest = p.textContent.split("\n").reduce((a, l) => l.length > a.length ? l : a, "");
      out.wide_list.push(kind + " " + longest.length + ": " + longest.slice(0, 90)); } }
    for (const m of document.querySelectorAll("mjx-container[display='true'], .math")) { if (m.scrollWidth > m.clientWidth + 1) out.wide_math++; }
    for (const img of document.querySelectorAll("img")) {
      const alt = img.getAttribute("alt") || "";
      if (!alt.trim() || /^[0-9a-f]{16,}/.test(alt) || /\.(png|svg|jpg)$/.test(alt)) out.bad_alt.push(alt || img.src.split("/").pop());
      if (!img.complete || img.naturalWidth === 0) out.broken_img++;
    }
    return out;
  });
  found.blocked = blocked.length; found.errors = errors;
  report[path.relative(root, file)] = found;
  await page.close();
}
await browser.close();
fs.writeFileSync(process.argv[3] || "report.json", JSON.stringify(report, null, 1));
const sum = k => Object.values(report).reduce((a, r) => a + (Array.isArray(r[k]) ? r[k].length : r[k]), 0);
console.log("pages", pages.length, "h1 mid-word", sum("h1_midword"), "wide pre", sum("wide_pre"), "of", sum("pre_total"),
  "wide math", sum("wide_math"), "bad alt", sum("bad_alt"), "broken img", sum("broken_img"), "blocked requests", sum("blocked"), "errors", sum("errors"));
for (const [p, r] of Object.entries(report)) if (r.h1_midword.length || r.wide_pre || r.wide_math || r.bad_alt.length || r.errors.length || r.broken_img)
  console.log(p, JSON.stringify({ h1: r.h1_midword, pre: r.wide_pre, math: r.wide_math, alt: r.bad_alt.length, err: r.errors.slice(0, 2), img: r.broken_img }));
