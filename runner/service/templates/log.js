// Follows a running job's log: the NDJSON stream from the last line the server rendered on.
// Lines are added with textContent only: guest output is never parsed as HTML.
"use strict";
(function () {
  const pre = document.getElementById("log");
  if (!pre || pre.dataset.final === "yes") return;
  const decoder = new TextDecoder();
  let after = Number(pre.dataset.after);
  function show(entry) {
    const span = document.createElement("span");
    span.className = entry.stream;
    const bytes = Uint8Array.from(atob(entry.data), (c) => c.charCodeAt(0));
    span.textContent = decoder.decode(bytes) + (entry.stream === "system" ? "\n" : "");  // notes are whole lines
    pre.appendChild(span);
    after = entry.seq;
  }
  function ended(job) {
    document.getElementById("state").textContent = job.state;
    document.getElementById("exit").textContent = job.exit_code === null ? "-" : String(job.exit_code);
  }
  async function follow() {
    const response = await fetch("/ui/jobs/" + encodeURIComponent(pre.dataset.job) + "/logs?after=" + after,
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
  follow().catch((error) => { pre.dataset.error = String(error); });
})();
