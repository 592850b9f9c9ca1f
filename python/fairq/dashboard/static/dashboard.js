// Live refresh: every data-refresh-ms, fetch this page again and swap in the parts
// marked data-live. Skipped while the tab is hidden or a form control has the focus
// (a select being chosen from must not vanish under the pointer).
(function () {
  "use strict";
  const main = document.querySelector("main[data-refresh-ms]");
  const status = document.getElementById("live-status");
  const every = main ? Number(main.dataset.refreshMs) : 0;
  if (!status || !every) {
    return;
  }
  // A notice ("dead letter 7: requeued") is shown once: a reload must not repeat it.
  const url = new URL(window.location.href);
  if (url.searchParams.has("notice")) {
    url.searchParams.delete("notice");
    url.searchParams.delete("notice_sig");
    window.history.replaceState(null, "", url.toString());
  }
  async function refresh() {
    const focused = document.activeElement;
    if (document.hidden || (focused && focused.closest("form"))) {
      return;
    }
    try {
      const response = await fetch(window.location.href, {credentials: "same-origin"});
      if (!response.ok) {
        throw new Error("HTTP " + response.status);
      }
      const fresh = new DOMParser().parseFromString(await response.text(), "text/html");
      document.querySelectorAll("[data-live]").forEach(function (part) {
        const replacement = fresh.getElementById(part.id);
        if (replacement) {
          part.replaceWith(document.importNode(replacement, true));
        }
      });
      status.textContent = "live: updated " + new Date().toLocaleTimeString();
      status.dataset.updates = String(Number(status.dataset.updates) + 1);
      status.classList.remove("stale");
    } catch (error) {
      status.textContent = "live: the dashboard did not answer (" + error.message + ")";
      status.classList.add("stale");
    }
  }
  window.setInterval(refresh, every);
})();
