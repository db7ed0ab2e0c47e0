// The run page: one uPlot chart per group of history keys (training, then each evaluation split), x axis by steps or minutes, and a poll
// of data.json that redraws the charts and adds new steps to the table without a reload.
(function () {
  "use strict";
  const spec = JSON.parse(document.getElementById("chart-spec").textContent);
  const box = document.getElementById("charts");
  const palette = ["#1558b0", "#c0392b", "#1c7c3a", "#8e44ad", "#b07a00", "#117a8b", "#6d4c41", "#e67e22"];
  let data = spec.data;
  let axis = "step";
  let plots = [];

  function columns(split, keys) {
    const rows = data[split] || { step: [], minutes: [], series: {} };
    const x = rows[axis].map(function (v) { return v === null ? NaN : v; });
    return [x].concat(keys.map(function (k) { return rows.series[k] || x.map(function () { return null; }); }));
  }

  function draw() {
    plots.forEach(function (p) { p.destroy(); });
    plots = [];
    box.textContent = "";
    const width = Math.max(420, Math.min(720, box.clientWidth / 2 - 16));
    spec.charts.forEach(function (chart, n) {
      const title = chart[0], split = chart[1], keys = chart[2];
      const figure = document.createElement("figure");
      figure.className = "chart";
      figure.setAttribute("aria-label", title);
      figure.dataset.chart = String(n);
      const caption = document.createElement("h3");
      caption.textContent = title;
      figure.appendChild(caption);
      box.appendChild(figure);
      const options = {
        width: width, height: 220,
        scales: { x: { time: false } },
        axes: [{ label: axis === "step" ? "step" : "minutes" }, {}],
        series: [{ label: axis }].concat(keys.map(function (k, i) {
          return { label: k, stroke: palette[i % palette.length], width: 1.5, points: { show: true, size: 4 } };
        })),
        legend: { live: true },
      };
      plots.push(new uPlot(options, columns(split, keys), figure));
    });
    document.body.dataset.points = String((data.train || { step: [] }).step.length);
  }

  function addSteps(steps) {
    const body = document.querySelector("#steps tbody");
    const known = new Map(Array.from(body.rows).map(function (r) { return [r.dataset.key, r]; }));
    steps.slice().reverse().forEach(function (s) {
      const key = s.split + "/" + s.step;
      const reward = s.reward === null || s.reward === undefined ? "—" : s.reward.toFixed(3);
      if (known.has(key)) {  // a training step's reward is logged after its groups are stored
        known.get(key).cells[2].textContent = reward;
        return;
      }
      const row = body.insertRow(0);
      row.dataset.key = key;
      const link = document.createElement("a");
      link.href = spec.url.replace(/data\.json$/, encodeURIComponent(s.split) + "/" + s.step);
      link.textContent = String(s.step);
      const cells = [row.insertCell(), row.insertCell(), row.insertCell()];
      cells[0].className = "num"; cells[2].className = "num";
      cells[0].appendChild(link);
      cells[1].textContent = s.split;
      cells[2].textContent = reward;
    });
  }

  document.querySelectorAll('input[name="x"]').forEach(function (input) {
    input.addEventListener("change", function () { axis = input.value; draw(); });
  });

  function poll() {
    fetch(spec.url, { credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
      .then(function (fresh) {
        const before = JSON.stringify([data, spec.charts]);
        data = fresh.data;
        spec.charts = fresh.charts;  // a page opened before the first training step has no training charts yet
        if (JSON.stringify([data, spec.charts]) !== before) { draw(); }
        addSteps(fresh.steps);
        document.getElementById("live").textContent = "live: updated " + new Date().toLocaleTimeString();
      })
      .catch(function () { document.getElementById("live").textContent = "live: the server did not answer"; })
      .finally(function () { setTimeout(poll, spec.poll * 1000); });
  }

  draw();
  setTimeout(poll, spec.poll * 1000);
})();
