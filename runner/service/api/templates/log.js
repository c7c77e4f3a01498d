// Follows a running job's log: the NDJSON stream from the last line the server rendered on, each line
// numbered, timestamped and marked by stream as the server renders them. Text is set with textContent
// only: guest output is never parsed as HTML.
"use strict";
(function () {
  const log = document.getElementById("log");
  if (!log || log.dataset.final === "yes") return;
  const decoder = new TextDecoder();
  let after = Number(log.dataset.after);
  let number = Number(log.dataset.line);
  const pad = (n, width) => String(n).padStart(width, "0");
  function clock(ts) {
    const d = new Date(ts * 1000);
    return pad(d.getUTCHours(), 2) + ":" + pad(d.getUTCMinutes(), 2) + ":" + pad(d.getUTCSeconds(), 2) + "." +
      pad(d.getUTCMilliseconds(), 3);
  }
  function line(entry, text) {
    number += 1;
    const row = document.createElement("div");
    row.className = "line " + entry.stream;
    row.id = "L" + number;
    const anchor = document.createElement("a");
    anchor.className = "n";
    anchor.href = "#L" + number;
    anchor.textContent = String(number);
    const time = document.createElement("time");
    time.textContent = clock(entry.ts);
    time.title = new Date(entry.ts * 1000).toISOString();
    const stream = document.createElement("span");
    stream.className = "s";
    stream.textContent = entry.stream === "stderr" ? "err" : entry.stream === "system" ? "note" : "";
    const body = document.createElement("span");
    body.className = "t";
    body.textContent = text;
    row.append(anchor, time, stream, body);
    log.appendChild(row);
  }
  // A piece of output that ends inside a line is continued by the next piece of the same stream, as the
  // server renders it (web._lines_of).
  let open = null;
  function show(entry) {
    const bytes = Uint8Array.from(atob(entry.data), (c) => c.charCodeAt(0));
    const parts = decoder.decode(bytes).split(/\r\n|\r|\n/);
    if (open && open.stream === entry.stream && entry.stream !== "system") {
      open.row.querySelector(".t").textContent += parts.shift();
      if (parts.length === 0) { after = entry.seq; return; }
    }
    open = null;
    const last = parts.pop();
    parts.forEach((text) => line(entry, text));
    if (last !== "") {
      line(entry, last);
      if (entry.stream !== "system") open = {stream: entry.stream, row: log.lastElementChild};
    }
    after = entry.seq;
  }
  function ended(job) {
    document.getElementById("state").textContent = job.state;
    document.getElementById("exit").textContent = job.exit_code === null ? "-" : String(job.exit_code);
    const result = job.state === "finished" ? (job.exit_code === 0 ? "success" : "failure") : job.state;
    document.getElementById("result").textContent = result.replace("_", " ");
    const cancel = document.getElementById("cancel");
    if (cancel) cancel.remove();
    log.dataset.final = "yes";
  }
  async function follow() {
    const response = await fetch("/ui/jobs/" + encodeURIComponent(log.dataset.job) + "/logs?after=" + after,
                                 {credentials: "same-origin"});
    const reader = response.body.getReader();
    let buffered = "";
    const text = new TextDecoder();
    for (;;) {
      const {value, done} = await reader.read();
      if (done) break;
      buffered += text.decode(value, {stream: true});
      let newline;
      while ((newline = buffered.indexOf("\n")) >= 0) {
        const item = JSON.parse(buffered.slice(0, newline));
        buffered = buffered.slice(newline + 1);
        if (item.end) ended(item.job); else show(item);
      }
    }
  }
  follow().catch((error) => { log.dataset.error = String(error); });
})();
