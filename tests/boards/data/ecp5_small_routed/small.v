// A tiny ECP5 design for the routed-timing parsers: a registered 8:1 pick into a
// 16-bit accumulator (LUTs, PFUMX and a carry chain), a block RAM and a multiplier.
module top(input clk, input [7:0] a, input [7:0] b, input [2:0] s, output reg [15:0] q);
  reg [7:0] ra, rb; reg [2:0] rs; reg [15:0] acc, mem_q, prod; reg [7:0] wa;
  reg [15:0] mem [0:511];
  wire [7:0] m [0:7];
  genvar i; generate for (i = 0; i < 8; i = i + 1) begin: g
    assign m[i] = ra ^ (rb << i);
  end endgenerate
  always @(posedge clk) begin
    ra <= a; rb <= b; rs <= s; wa <= wa + 1;
    acc <= acc + m[rs];
    mem[{1'b0, wa}] <= acc; mem_q <= mem[{1'b0, ra}];
    prod <= ra * rb;
    q <= acc ^ mem_q ^ prod;
  end
endmodule
